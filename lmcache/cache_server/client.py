"""`CacheServerClient`: an engine's attachment to a cache server, and the engine's allocator.

It is the engine's `MemoryAllocatorInterface`: `allocate` reserves a slot in the server's
shared arena and returns a `ServerSlot` viewing it, so the engine's connector copies a chunk
straight into L1 (the only copy); `commit` (called by the cache-server tier when the storage
manager puts the chunk) makes the server keep it. `get` returns `ServerSlot`s viewing chunks the
server holds for this engine until the slot's last reference goes (then the server is told).

Attachment: `hello` gives a session id, an engine id and the arena's name; the arena is mapped
here. A thread sends a heartbeat every interval the server asked for; it also attaches (again)
whenever the engine is not attached, so a server that starts late, or again after a crash, is
used without restarting the engine. A failed exchange (no answer within `timeout`, the
connection dropped, a reply saying the server restarted or forgot this engine) detaches: until
the next attach every call answers a miss at once (stores are skipped, loads find nothing) and
the outage is logged once (`IncidentLog`). Only requests that are safe to repeat are retried on
a new attachment; slots of an old attachment are never committed to a new server (its memory is a
different segment), and an old arena stays mapped until the last object viewing it is gone.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from lmcache.cache_key import CacheEngineKey, dtype_tag
from lmcache.cache_server import messages as m
from lmcache.cache_server.shm import SharedArena
from lmcache.config import LMCacheEngineMetadata
from lmcache.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.observability import Counters, IncidentLog

logger = logging.getLogger(__name__)

RETRY_SAFE = frozenset({"contains", "lease", "reserve", "get"})


class ServerAway(ConnectionError):
    """The exchange with the server failed: it is not attached, did not answer, or restarted."""


class ServerSlot(TensorMemoryObj):
    """Memory in the server's arena: a slot this engine reserved (`read` None) or a chunk the
    server holds for it (`read`)."""

    def __init__(self, attachment: Attachment, offset: int, shape: torch.Size, dtype: torch.dtype,
                 slot: int | None = None, read: int | None = None) -> None:
        nbytes = shape.numel() * dtype.itemsize
        if not 0 <= offset <= attachment.arena.size - nbytes:
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
    `ServerSlot`s viewing that arena (their `free` tells the server)."""

    def __init__(self, client: CacheServerClient, session: str, engine: str, arena: SharedArena) -> None:
        self.client = client
        self.session = session
        self.engine = engine
        self.arena = arena
        self.lock = threading.Lock()
        self.live = 0
        self.detached = False

    def free(self, obj: MemoryObj) -> None:
        assert isinstance(obj, ServerSlot)
        if obj.read is not None:
            self.client.notify(self, "release", reads=[obj.read])
        elif not obj.committed:
            self.client.notify(self, "abort", slot=obj.slot)
        with self.lock:
            self.live -= 1
            unmap = self.detached and self.live == 0
        if unmap:
            self.arena.close()

    def adopt(self, obj: ServerSlot) -> ServerSlot:
        with self.lock:
            self.live += 1
        return obj

    def detach(self) -> None:
        with self.lock:
            self.detached = True
            unmap = self.live == 0
        if unmap:
            self.arena.close()


class CacheServerClient(MemoryAllocatorInterface):
    def __init__(self, url: str, metadata: LMCacheEngineMetadata, timeout: float = 5.0,
                 name: str | None = None) -> None:
        self.url = url
        self.metadata = metadata
        self.timeout = timeout
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.heartbeat = 1.0  # until a server says otherwise
        self.counts = Counters()
        self._io = threading.RLock()  # the socket and the attachment
        self._zmq = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self.attachment: Attachment | None = None
        self._incidents = IncidentLog(logger, f"the cache server at {url}",
                                      consequence="the engine computes what it would have loaded and stores "
                                                  "nothing until the server is back")
        self._closed = threading.Event()
        with self._io:
            self._try_attach()
        self._beats = threading.Thread(target=self._beat, daemon=True, name="lmcache-cache-server")
        self._beats.start()

    # ---- attachment -----------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self.attachment is not None

    def _try_attach(self) -> Attachment | None:
        """Attach now if not attached (the I/O lock held); None if the server does not answer."""
        if self.attachment is not None or self._closed.is_set():
            return self.attachment
        try:
            self._connect()
            reply = self._exchange(None, {"op": "hello", "pid": os.getpid(), "name": self.name,
                                          "metadata": m.metadata_to_wire(self.metadata)},
                                   self._short_timeout)
            arena = SharedArena.attach(reply["arena"], int(reply["arena_size"]))
        except (ServerAway, OSError, ValueError, KeyError, TypeError) as e:
            self._disconnect()
            self._incidents.fail(f"cannot attach: {e}")
            return None
        self.heartbeat = float(reply["heartbeat"])
        self.attachment = Attachment(self, reply["session"], reply["engine"], arena)
        self.counts.add("attaches")
        logger.info("attached to the LMCache cache server at %s (session %s, engine %s, L1 %.2f GB)",
                    self.url, reply["session"], reply["engine"], arena.size / (1 << 30))
        self._incidents.recover()
        return self.attachment

    def _detach(self, why: BaseException) -> None:
        """The attachment is gone (the I/O lock held): calls answer misses until the next attach."""
        self._incidents.fail(why)
        if self.attachment is not None:
            self.attachment.detach()
            self.attachment = None
        self._disconnect()

    def _connect(self) -> None:
        self._disconnect()
        self._sock = self._zmq.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.url)

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None

    @property
    def _short_timeout(self) -> float:
        """How long a hello or heartbeat may take: about one heartbeat."""
        return min(self.timeout, max(self.heartbeat, 0.5))

    def _beat(self) -> None:
        while not self._closed.wait(self.heartbeat):
            with self._io:
                if self._closed.is_set():
                    return
                attachment = self.attachment or self._try_attach()
                if attachment is None:
                    continue
                try:
                    self._exchange(attachment, {"op": "heartbeat"}, self._short_timeout)
                except ServerAway as e:
                    self._detach(e)

    # ---- exchanges ------------------------------------------------------------------------------

    def _exchange(self, attachment: Attachment | None, request: dict[str, Any],
                  timeout: float) -> dict[str, Any]:
        """Send `request` and wait for its answer (the I/O lock held)."""
        sock, monitor = self._sock, self._monitor
        if sock is None or monitor is None:
            raise ServerAway("not connected")
        request_id = next(self._ids)
        if attachment is not None:
            request = {**request, "session": attachment.session, "engine": attachment.engine}
        sock.send(m.encode({**request, "id": request_id}))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(left * 1000))))
            if monitor in ready:
                raise ServerAway("the connection to the server dropped")
            if sock not in ready:
                continue
            reply = m.decode_reply(sock.recv_multipart())
            if reply.get("id") != request_id:
                continue  # the answer to an earlier request that timed out
            if reply.get("ok"):
                return reply
            if reply.get("code") in ("session", "engine"):
                raise ServerAway(reply.get("error", "this attachment is no longer valid"))
            raise ServerAway(f"the server refused {request['op']}: {reply.get('error')}")
        raise ServerAway(f"no answer to {request['op']} within {timeout:g} s")

    def call(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """Request `op`; the answer, or None (a miss) when not attached or the exchange fails (an
        outage: detached). After a failed exchange, a request that is safe to repeat tries one
        attach and asks again (a server that restarted answers at once)."""
        with self._io:
            for attempt in (0, 1):
                attachment = self.attachment if attempt == 0 else self._try_attach()
                if attachment is None:
                    self.counts.add("skipped")
                    return None
                try:
                    return self._exchange(attachment, {"op": op, **fields}, self.timeout)
                except ServerAway as e:  # a restarted server may be there already: one attach to see
                    self.counts.add("failures")
                    self._detach(e)
                    if op not in RETRY_SAFE:
                        break
        return None

    def notify(self, attachment: Attachment, op: str, **fields: Any) -> None:
        """Tell the server `op` about `attachment`'s objects, without waiting; dropped when that
        attachment is gone (its server reclaimed everything of it already)."""
        with self._io:
            if attachment is not self.attachment or self._sock is None:
                return
            message = {"op": op, "session": attachment.session, "engine": attachment.engine, **fields}
            try:
                self._sock.send(m.encode(message), zmq.NOBLOCK)
            except zmq.Again:
                self.counts.add("notifications_dropped")

    # ---- the allocator --------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.attached

    def allocate(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None,
                 fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> ServerSlot | None:
        shape, dtype = torch.Size(shape), dtype or torch.uint8
        with self._io:
            reply = self.call("reserve", shape=list(shape), dtype=dtype_tag(dtype))
            attachment = self.attachment
            if reply is None or reply.get("slot") is None or attachment is None:
                return None
            return attachment.adopt(ServerSlot(attachment, int(reply["offset"]), shape, dtype,
                                               slot=int(reply["slot"])))

    def free(self, memory_obj: Any) -> None:
        raise AssertionError("a ServerSlot is freed by its attachment")

    def commit(self, key: CacheEngineKey, obj: Any) -> bool:
        """Make the slot `obj` (filled) the server's chunk for `key`; False if it cannot be (not a
        slot of the current attachment, or already committed)."""
        with self._io:
            if not isinstance(obj, ServerSlot) or obj.read is not None or obj.committed \
                    or obj.attachment is not self.attachment:
                self.counts.add("commits_dropped")
                return False
            obj.committed = True
            self.notify(obj.attachment, "commit", slot=obj.slot, key=key.to_string())
        self.counts.add("commits")
        return True

    def get(self, keys: Sequence[CacheEngineKey]) -> list[ServerSlot]:
        """The server's chunks for the cached prefix of `keys` (one reference each, the caller's)."""
        with self._io:
            reply = self.call("get", keys=[k.to_string() for k in keys])
            attachment = self.attachment
            if reply is None or attachment is None:
                return []
            out: list[ServerSlot] = []
            for i, (read, offset, shape, dtype) in enumerate(reply["objs"]):
                try:
                    out.append(attachment.adopt(ServerSlot(attachment, offset, torch.Size(shape),
                                                           m.DTYPES[dtype], read=read)))
                except (ServerAway, KeyError, TypeError, ValueError) as e:  # a bad answer ends the prefix
                    self.counts.add("bad_replies")
                    logger.warning("cache server: unusable chunk in a get reply (%s); the prefix ends there",
                                   e)
                    self.notify(attachment, "release", reads=[r[0] for r in reply["objs"][i:]])
                    break
            return out

    # ---- end ------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._beats.join(timeout=self.timeout + self.heartbeat)
        with self._io:
            if self.attachment is not None:
                self.notify(self.attachment, "bye")
                self.attachment.detach()
                self.attachment = None
            self._disconnect()
        self._zmq.term()
