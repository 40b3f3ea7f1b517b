"""`CacheServerClient`: an engine's attachment to a cache server, and the engine's allocator.

It is the engine's `MemoryAllocatorInterface`: `allocate_many` reserves slots for all of a
store's chunks in the server's shared arena in one request and returns `ServerSlot`s viewing
them, so the engine's connector copies the chunks straight into L1 (the only copy); `commit`
(called by the cache-server tier when the storage manager puts the chunks) makes the server keep
them, in one notification. `get` returns `ServerSlot`s viewing chunks the server holds for this
engine until each slot's last reference goes; those releases (and aborted slots) are told to the
server with the engine's next request or heartbeat, in one message.

Attachment: `hello` gives a session id, an engine id and the arena's name; the arena is mapped
here. A thread sends a heartbeat every interval the server asked for, maps the arena pages the
server has grown (so copies take no page faults), and attaches (again) whenever the engine is not
attached, so a server that starts late, or again after a crash, is used without restarting the
engine. A failed exchange (no answer within `timeout`, the connection dropped, a reply saying the
server restarted, forgot this engine or failed on the request) detaches: until the next attach
every call answers a miss at once (stores are skipped, loads find nothing). A request the server
refuses as malformed (code "bad") is a miss too, counted in ``refused``, but no outage: the engine
stays attached (a refused ``hello`` leaves it detached, asking again every heartbeat). A reply
naming a slot or chunk that cannot be (outside the arena, malformed) ends at it, counted in
``bad_replies``: the slots and reads it names from there on are given back. A request that is
safe to repeat looks once for a restarted server (`RETRY_ATTACH_TIMEOUT`). Closing the client ends
an exchange still waiting for its answer (`Closing`, not a fault), so an engine shuts down at once
even if its server stalled. Slots of an old attachment are never committed to a new server (its
memory is a different segment); an old arena stays mapped until the last object viewing it is
gone, and an attachment given up on a server that is still there (a timeout) is then retired with
a ``bye``.

Faults are caught, counted and logged by one `FailureDomains` guard with one domain, the server
(`lmcache.failures`): a request's exchange goes through `run` (a failed one counted in
``failures``), a call not made while detached is counted in ``skipped`` (`skip`), and the
attaches and heartbeats are its `probe`s (not counted: no request failed; an attach that works
ends the incident), so an outage is one warning, however many requests it turned into misses.
Being detached, not the guard's backoff, is what keeps requests off an absent server: the
heartbeat thread looks for it every interval.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import zmq

from lmcache.cache_key import CacheEngineKey, dtype_tag
from lmcache.cache_server import messages as m
from lmcache.cache_server.shm import SharedArena
from lmcache.chunk_hash import ChunkText
from lmcache.config import LMCacheEngineMetadata
from lmcache.failures import DomainFault, FailureDomains
from lmcache.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.observability import Counters, log_once

logger = logging.getLogger(__name__)

PAGE = 4096
RETRY_SAFE = frozenset({"contains", "lease", "reserve", "get"})
RETRY_ATTACH_TIMEOUT = 0.2  # a request's one look for a restarted server (a live one answers in ms)
CLOSE_CHECK = 0.05  # how often an exchange waiting for its answer looks whether the client closed
MAX_HEARTBEAT = 86400.0  # the longest heartbeat interval a server may ask for (seconds)
SERVER = "server"  # the client's one failure domain


def _is_id(value: Any) -> bool:
    """Whether `value` of a reply is an int >= 0, as the server's slot and read ids and offsets are
    (a bool or a float is not: a release naming one would be refused whole)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _id(value: Any) -> int:
    if not _is_id(value):
        raise ValueError(f"{value!r} is not an int >= 0")
    return value


class ServerAway(ConnectionError):
    """The exchange with the server failed: it is not attached, did not answer, or restarted."""


class Refused(Exception):
    """The server refused a request as malformed (code "bad"): nothing of it was done. A fault of
    that request, not of the server: the engine stays attached and the request is a miss."""


class Closing(Exception):
    """The client was closed while an exchange waited for its answer (not a fault of the server:
    closing does not wait up to `timeout` for a server that stalled)."""


class ServerSlot(TensorMemoryObj):
    """Memory in the server's arena: a slot this engine reserved (`read` None) or a chunk the
    server holds for it (`read`)."""

    def __init__(self, attachment: Attachment, offset: int, shape: torch.Size, dtype: torch.dtype,
                 slot: int | None = None, read: int | None = None) -> None:
        nbytes = math.prod(shape) * dtype.itemsize  # in Python ints: torch's numel() wraps around int64
        if min(shape, default=0) < 0 or not 0 <= offset <= attachment.arena.size - nbytes:
            raise ServerAway(f"the server named bytes {offset}..{offset + nbytes} of a "
                             f"{attachment.arena.size}-byte arena")
        raw = attachment.arena.tensor[offset:offset + nbytes]
        super().__init__(raw, MemoryObjMetadata(shape, dtype, offset, nbytes, 1, MemoryFormat.KV_BLOB),
                         attachment)
        self.attachment = attachment
        self.slot = slot
        self.read = read
        self.committed = False


class Attachment:
    """One `hello`'s result: the session, this engine's id and the mapped arena. It owns the
    `ServerSlot`s viewing that arena (their `free` tells the server). Once detached and no slot
    of it is alive, its arena is unmapped and the client retires it (`CacheServerClient.retire`)."""

    def __init__(self, client: CacheServerClient, session: str, engine: str, arena: SharedArena,
                 wants_texts: bool = False) -> None:
        """`wants_texts`: the server publishes KV events, so commits carry the chunks' texts."""
        self.client = client
        self.session = session
        self.engine = engine
        self.arena = arena
        self.wants_texts = wants_texts
        self.lock = threading.Lock()
        self.live = 0
        self.detached = False
        self.releases: list[int] = []  # reads and slots given back, told with the next request
        self.aborts: list[int] = []
        self.mapped = 0  # the arena's first bytes whose pages this process has mapped

    def map_pages(self, grown: Any) -> None:
        """Map the pages of the arena's first `grown` bytes into this process now (a read of each),
        so a copy into or out of a slot there takes no page fault: the server wrote those pages
        already, so nothing new is allocated. Called by the heartbeat thread, off the request path."""
        if not isinstance(grown, int) or not self.mapped < grown <= self.arena.size:
            return
        with self.lock:
            if self.detached:
                return
            self.live += 1  # keeps the arena mapped meanwhile
        try:
            self.arena.tensor[self.mapped:grown:PAGE].sum()
            self.mapped = grown
        finally:
            self._drop()

    def free(self, obj: MemoryObj) -> None:
        assert isinstance(obj, ServerSlot)
        with self.lock:
            if obj.read is not None:
                self.releases.append(obj.read)
            elif not obj.committed and obj.slot is not None:
                self.aborts.append(obj.slot)
        self._drop()

    def given_back(self) -> tuple[list[int], list[int]]:
        """The reads and the slots given back since the last call (to tell the server)."""
        with self.lock:
            out = self.releases, self.aborts
            self.releases, self.aborts = [], []
        return out

    def _drop(self) -> None:
        """One user of the arena fewer; the last one after `detach` unmaps it."""
        with self.lock:
            self.live -= 1
            done = self.detached and self.live == 0
        if done:
            self._done()

    def hold(self) -> None:
        """One user of the arena more (a slot, or a reply whose slots are being made): the arena
        stays mapped until it `let_go`es. Only while attached (the client's I/O lock held, this
        the current attachment), so it is never mapped again once unmapped."""
        with self.lock:
            assert not self.detached, "a detached attachment's arena may be unmapped already"
            self.live += 1

    def let_go(self) -> None:
        """A `hold` ends."""
        self._drop()

    def adopt(self, obj: ServerSlot) -> ServerSlot:
        """`obj` (made while a `hold` on this attachment is in force) is a user of its arena."""
        with self.lock:
            self.live += 1
        return obj

    def detach(self) -> None:
        with self.lock:
            self.detached = True
            done = self.live == 0
        if done:
            self._done()

    def _done(self) -> None:
        self.arena.close()
        self.client.retire(self)


class _Link:
    """A DEALER socket to the server and a monitor of its connection (a drop ends an exchange at
    once instead of after its timeout)."""

    def __init__(self, context: zmq.Context, url: str, closed: threading.Event) -> None:
        self.closed = closed
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(url)

    def exchange(self, request: dict[str, Any], request_id: int, timeout: float) -> dict[str, Any]:
        """Send `request` and wait for its answer; `Closing` if the client closes meanwhile."""
        self.sock.send(m.encode({**request, "id": request_id}))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(min(left, CLOSE_CHECK) * 1000))))
            if self.closed.is_set():
                raise Closing(request["op"])
            if self.monitor in ready:
                raise ServerAway("the connection to the server dropped")
            if self.sock not in ready:
                continue
            reply = m.decode_reply(self.sock.recv_multipart())
            if reply.get("id") != request_id:
                continue  # the answer to an earlier request that timed out
            if reply.get("ok"):
                return reply
            if reply.get("code") == "bad":
                raise Refused(f"the server refused {request['op']} as malformed: {reply.get('error')}")
            if reply.get("code") in ("session", "engine"):
                raise ServerAway(reply.get("error", "this attachment is no longer valid"))
            raise ServerAway(f"the server failed on {request['op']}: {reply.get('error')}")
        raise ServerAway(f"no answer to {request['op']} within {timeout:g} s")

    def send(self, message: dict[str, Any]) -> bool:
        try:
            self.sock.send(m.encode(message), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        self.sock.disable_monitor()
        self.sock.close(0)
        self.monitor.close(0)


class CacheServerClient(MemoryAllocatorInterface):
    def __init__(self, url: str, metadata: LMCacheEngineMetadata, timeout: float = 5.0,
                 name: str | None = None) -> None:
        self.url = url
        self.metadata = metadata
        self.timeout = timeout
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.heartbeat = 1.0  # until a server says otherwise
        self.counts = Counters()  # what is not a fault: attaches, commits, dropped notifications
        self.faults = FailureDomains(lambda _: f"the cache server at {url}",
                                     consequence="the engine computes what it would have loaded and "
                                                 "stores nothing until the server is back",
                                     passthrough=(Closing, Refused))
        self.client_id = uuid.uuid4().hex  # lets the server drop attachments this client gave up on
        self._io = threading.RLock()  # the link and the attachment
        self._zmq = zmq.Context()
        self._link: _Link | None = None
        self._ids = itertools.count(1)
        self.attachment: Attachment | None = None
        self._retired: list[Attachment] = []  # detached, waiting to be given back to their server
        self._closed = threading.Event()
        self._try_attach()
        self._beats = threading.Thread(target=self._beat, daemon=True, name="lmcache-cache-server")
        self._beats.start()

    # ---- attachment -----------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self.attachment is not None

    def _try_attach(self, timeout: float | None = None) -> Attachment | None:
        """Attach now if not attached; None if the server does not answer within `timeout`
        (default: about a heartbeat). The hello is sent on a new link without the I/O lock: engine
        calls meanwhile answer misses at once."""
        if self.attachment is not None or self._closed.is_set():
            return self.attachment
        link = _Link(self._zmq, self.url, self._closed)
        wait = timeout if timeout is not None else min(self.timeout, max(self.heartbeat, 0.5))
        try:
            attachment, heartbeat = self.faults.probe(SERVER, partial(self._hello, link, wait))
        except Refused as e:  # asked again every heartbeat, as an absent server is
            link.close()
            self._refused("hello", e)
            return None
        except (DomainFault, Closing):
            link.close()
            return None
        with self._io:
            if self.attachment is not None or self._closed.is_set():  # attached meanwhile
                link.send({"op": "bye", "session": attachment.session, "engine": attachment.engine})
                link.close()
                attachment.arena.close()
                return self.attachment
            self._link, self.attachment = link, attachment
            self.heartbeat = heartbeat
            self.counts.add("attaches")
            logger.info("attached to the LMCache cache server at %s (session %s, engine %s, L1 %.2f GB)",
                        self.url, attachment.session, attachment.engine, attachment.arena.size / (1 << 30))
            for old in list(self._retired):
                self.retire(old)
        return attachment

    def _hello(self, link: _Link, wait: float) -> tuple[Attachment, float]:
        """Attach on `link`: the attachment and the heartbeat interval the server asks for;
        ServerAway if the server does not answer within `wait` or answers something unusable."""
        hello = {"op": "hello", "pid": os.getpid(), "name": self.name, "client": self.client_id,
                 "metadata": m.metadata_to_wire(self.metadata)}
        try:
            reply = link.exchange(hello, next(self._ids), wait)
            heartbeat = float(reply["heartbeat"])
            if not 0 < heartbeat <= MAX_HEARTBEAT:  # 0 would have the thread hammer it, inf end it
                raise ValueError(f"the server asks for a heartbeat every {heartbeat} s")
            arena = SharedArena.attach(reply["arena"], int(reply["arena_size"]))
        except (OSError, ValueError, KeyError, TypeError) as e:  # ServerAway is an OSError
            raise ServerAway(f"cannot attach: {e}") from e
        attachment = Attachment(self, reply["session"], reply["engine"], arena, reply.get("texts") is True)
        return attachment, heartbeat

    def _detach(self) -> None:
        """The attachment is gone (the I/O lock held; the fault was counted and logged by `faults`):
        calls answer misses until the next attach."""
        attachment, self.attachment = self.attachment, None
        if self._link is not None:
            self._link.close()
            self._link = None
        if attachment is not None:
            attachment.detach()

    def retire(self, attachment: Attachment) -> None:
        """`attachment` is detached and nothing of it is alive. If its server is still the one
        attached to (it did not restart; e.g. an exchange timed out), tell it that engine left, so
        what the server held for it is given back; until then keep it to tell later."""
        with self._io:
            current, link = self.attachment, self._link
            if current is None or link is None:
                if attachment not in self._retired:
                    self._retired.append(attachment)
                return
            if attachment in self._retired:
                self._retired.remove(attachment)
            if attachment.session == current.session and attachment is not current:
                link.send({"op": "bye", "session": attachment.session, "engine": attachment.engine})

    def _beat(self) -> None:
        while not self._closed.wait(self.heartbeat):
            try:
                attachment = self.attachment or self._try_attach()
            except zmq.ZMQError as e:  # no socket now (out of file descriptors?): the next beat looks again
                log_once(logger, "no socket", "cache server: cannot open a socket to it (%s); looked for "
                         "again every heartbeat (logged once)", e)
                continue
            if attachment is None:
                continue
            with self._io:
                if self._closed.is_set() or attachment is not self.attachment or self._link is None:
                    continue
                self._tell_given_back(attachment)
                beat = {"op": "heartbeat", "session": attachment.session, "engine": attachment.engine}
                try:
                    reply = self.faults.probe(SERVER, partial(self._link.exchange, beat, next(self._ids),
                                                              self.timeout))
                except Closing:
                    return
                except Refused as e:
                    self._refused("heartbeat", e)
                    continue
                except DomainFault:
                    self._detach()
                    continue
            attachment.map_pages(reply.get("grown"))

    # ---- exchanges ------------------------------------------------------------------------------

    def call(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """Request `op`; the answer, or None (a miss) when not attached, the server refuses the
        request as malformed (counted in ``refused``; still attached) or the exchange fails (an
        outage: detached). After a failed exchange, a request that is safe to repeat tries one
        attach (without the I/O lock) and asks again: a server that restarted answers at once."""
        answered = self._request(op, fields)
        if answered is None:
            return None
        reply, attachment = answered
        attachment.let_go()
        return reply

    def _request(self, op: str, fields: dict[str, Any]) -> tuple[dict[str, Any], Attachment] | None:
        """`call`, with the attachment that answered, held (`Attachment.hold`): the caller makes
        the reply's slots on it, then lets go. Another thread may detach meanwhile (its exchange
        failed), but the arena stays mapped until then."""
        for attempt in (0, 1):
            attachment = self.attachment if attempt == 0 else self._try_attach(RETRY_ATTACH_TIMEOUT)
            with self._io:
                if attachment is None or attachment is not self.attachment or self._link is None:
                    if attempt == 0:  # (a retry not made is no call of its own: the first was counted)
                        self.faults.skip(SERVER)
                    return None
                request = {"op": op, "session": attachment.session, "engine": attachment.engine, **fields}
                self._tell_given_back(attachment)
                exchange = partial(self._link.exchange, request, next(self._ids), self.timeout)
                try:
                    reply = self.faults.run(SERVER, exchange)
                except Closing:
                    return None
                except Refused as e:
                    self._refused(op, e)
                    return None
                except DomainFault:
                    self._detach()
                else:
                    attachment.hold()
                    return reply, attachment
            if op not in RETRY_SAFE:
                break
        return None

    def _refused(self, op: str, error: Refused) -> None:
        self.counts.add("refused")
        log_once(logger, ("refused", op), "cache server: %s (logged once per request kind)", error)

    def notify(self, attachment: Attachment, op: str, **fields: Any) -> None:
        """Tell the server `op` about `attachment`'s objects, without waiting; dropped when that
        attachment is gone (its server reclaims everything of it: see `retire`)."""
        with self._io:
            if attachment is not self.attachment or self._link is None:
                return
            message = {"op": op, "session": attachment.session, "engine": attachment.engine, **fields}
            if not self._link.send(message):
                self.counts.add("notifications_dropped")

    def _tell_given_back(self, attachment: Attachment) -> None:
        """Release the reads and abort the slots `attachment` gave back (the I/O lock held): in the
        order of the engine's requests, before the next one, or with the next heartbeat."""
        reads, slots = attachment.given_back()
        if reads:
            self.notify(attachment, "release", reads=reads)
        if slots:
            self.notify(attachment, "abort", slots=slots)

    # ---- the allocator --------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.attached

    def allocate(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None,
                 fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> ServerSlot | None:
        got = self.allocate_many([torch.Size(shape)], dtype, fmt)
        return got[0] if got else None  # type: ignore[return-value]  # a ServerSlot

    def allocate_many(self, shapes: Sequence[torch.Size], dtype: torch.dtype | None,
                      fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> list[MemoryObj]:
        """Slots for the leading `shapes` that fit in the server's L1, reserved in one request."""
        dtype = dtype or torch.uint8
        if not shapes:
            return []
        answered = self._request("reserve", {"shapes": [list(s) for s in shapes], "dtype": dtype_tag(dtype)})
        if answered is None:
            return []
        reply, attachment = answered

        def slot(i: int, entry: Any) -> ServerSlot:
            if i >= len(shapes):
                raise ValueError(f"more slots than the {len(shapes)} shapes asked for")
            slot_id, offset = entry
            return ServerSlot(attachment, _id(offset), shapes[i], dtype, slot=_id(slot_id))

        try:
            return list(self._adopt(attachment, "reserve", reply.get("slots"), slot, ("abort", "slots")))
        finally:
            attachment.let_go()

    def free(self, memory_obj: Any) -> None:
        raise AssertionError("a ServerSlot is freed by its attachment")

    @property
    def wants_texts(self) -> bool:
        """Whether the server attached to publishes KV events (commits then carry texts)."""
        attachment = self.attachment
        return attachment is not None and attachment.wants_texts

    def commit(self, keys: Sequence[CacheEngineKey], objs: Sequence[Any],
               texts: Sequence[ChunkText | None] | None = None) -> int:
        """Make the slots `objs` (filled) the server's chunks for `keys`, in one message, with their
        `texts` where given and the server wants them (for its KV events); how many were committed
        (not: objects that are not slots of the current attachment, or committed already). The
        message is one-way: this client's next request is answered after the server applied it;
        another engine's may be answered before."""
        with self._io:
            attachment = self.attachment
            triples = [(k, o, t) for k, o, t in zip(keys, objs, texts or [None] * len(keys), strict=True)
                       if isinstance(o, ServerSlot) and o.read is None and not o.committed
                       and o.attachment is attachment]
            if len(triples) < len(keys):
                self.counts.add("commits_dropped", len(keys) - len(triples))
            if not triples or attachment is None:
                return 0
            for _, obj, _ in triples:
                obj.committed = True
            fields: dict[str, Any] = {"slots": [o.slot for _, o, _ in triples],
                                      "keys": [k.to_string() for k, _, _ in triples]}
            if attachment.wants_texts and any(t is not None for *_, t in triples):
                fields["texts"] = [m.text_to_wire(t) for *_, t in triples]
            self.notify(attachment, "commit", **fields)
        self.counts.add("commits", len(triples))
        return len(triples)

    def get(self, keys: Sequence[CacheEngineKey]) -> list[ServerSlot]:
        """The server's chunks for the cached prefix of `keys` (one reference each, the caller's)."""
        answered = self._request("get", {"keys": [k.to_string() for k in keys]})
        if answered is None:
            return []
        reply, attachment = answered

        def chunk(i: int, entry: Any) -> ServerSlot:
            read, offset, shape, dtype = entry
            return ServerSlot(attachment, _id(offset), torch.Size(shape), m.DTYPES[dtype], read=_id(read))

        try:
            return self._adopt(attachment, "get", reply.get("objs"), chunk, ("release", "reads"))
        finally:
            attachment.let_go()

    def _adopt(self, attachment: Attachment, op: str, entries: Any, make: Callable[[int, Any], ServerSlot],
               give_back: tuple[str, str]) -> list[ServerSlot]:
        """`make(i, entry)` of each of the `entries` of a reply to `op` (made while `attachment`
        is held), up to the first unusable one: a bad reply (counted in ``bad_replies``) ends there,
        and the ids the rest name (an entry's first field) are given back to the server with the
        notification `give_back` = (op, field), so that it holds nothing for slots never made."""
        out: list[ServerSlot] = []
        if not isinstance(entries, list):
            self._bad_reply(op, f"no list but {str(entries)[:100]}")
            return out
        for i, entry in enumerate(entries):
            try:
                out.append(attachment.adopt(make(i, entry)))
            except (ServerAway, LookupError, TypeError, ValueError) as e:
                self._bad_reply(op, f"{type(e).__name__}: {e}")
                ids = [rest[0] for rest in entries[i:] if isinstance(rest, list) and rest and _is_id(rest[0])]
                if ids:
                    self.notify(attachment, give_back[0], **{give_back[1]: ids})
                break
        return out

    def _bad_reply(self, op: str, why: str) -> None:
        self.counts.add("bad_replies")
        log_once(logger, ("bad reply", op), "cache server: an unusable entry in a %s reply (%s); the reply "
                 "ends there and the rest is given back (logged once per request kind)", op, why)

    # ---- end ------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._beats.join(timeout=self.timeout + self.heartbeat)
        with self._io:
            attachment, link = self.attachment, self._link
            if attachment is not None and link is not None:
                link.send({"op": "bye", "session": attachment.session, "engine": attachment.engine})
            self.attachment, self._link = None, None
            if link is not None:
                link.close()
            if attachment is not None:
                attachment.detach()
        self._zmq.term()
