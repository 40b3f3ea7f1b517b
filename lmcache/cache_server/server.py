"""`CacheServer`: one process per host that owns the L1 (a shared-memory arena) and the L2 tiers,
and serves the engines attached to it over a ZMQ control socket (`messages`).

The tiers are the in-process engine's: per model (engine metadata) one `StorageManager` over the
shared arena, with the server's configuration for the lower tiers (disk, remote, ...), so prefix
batching, leases, promotion and the failure policy are the same code. The models share the arena
and one eviction order (`EvictionDomain`): a full arena evicts the least recently used chunks of
any model, and a store that still finds no room is dropped (the engine answers from its own
computation), never blocked.

One thread serves the socket; a request that may wait on a lower tier (`IO_OPS` of a model that
has lower tiers: a disk read, a remote round trip) runs on one of `IO_WORKERS` threads and its
answer is sent when it is ready, so the other engines are served meanwhile.

KV bytes never pass through the control socket: a store reserves a slot (`reserve`), the engine
copies the chunk into the arena at the slot's offset, and `commit` makes it visible under its
key; until then nobody can read it. A `get` hands out offsets of chunks held for that engine until
it `release`s them: the server never evicts or reuses memory an engine may still be reading.

With `kv_events_endpoint` (``--kv-events``) the server publishes what its tiers store and drop
as vLLM KV events on a ZMQ endpoint of its own (`kv_events`).

The operations endpoint (`ops`, its own threads) takes a snapshot of the models under the lock
and waits on their tiers without it: an operator's lookup, clear or stats call against a slow
remote store never holds up an engine's request.

Engines are watched two ways. Each sends a heartbeat every `heartbeat` seconds. The server also
watches the engine's process (a pidfd, when the engine's pid is visible from here): when it exits,
its slots, reads and leases are given back at once. An engine silent for `MISSED_HEARTBEATS`
heartbeats loses its leases; its slots and reads are reclaimed then only if its process cannot be
watched (memory a live but stalled process may still be copying is never reused). A restarted
server has a new `session` id, so an engine notices a restart even between two heartbeats.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from lmcache.cache_key import CacheEngineKey, dtype_tag
from lmcache.cache_server import messages as m
from lmcache.cache_server.kv_events import ServerEvents
from lmcache.cache_server.messages import BadMessage
from lmcache.cache_server.shm import SharedArena, process_alive, remove_stale
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import (
    MemoryFormat,
    MemoryObj,
    MixedMemoryAllocator,
    TensorMemoryAllocator,
    release_all,
)
from lmcache.memory_management.allocators import GROW_BYTES
from lmcache.observability import Counters, TierStats
from lmcache.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.storage_backend.evictor import EvictionDomain
from lmcache.storage_backend.storage_manager import PrefixLookup, StorageManager
from lmcache.token_database import ChunkedTokenDatabase, ChunkSpan

logger = logging.getLogger(__name__)

MISSED_HEARTBEATS = 2
IO_WORKERS = 4
STOP_CHECK = 1.0  # the loop looks at least this often (seconds) whether it was asked to stop
IO_OPS = frozenset({"contains", "lease", "get"})  # may wait on a lower tier (disk, remote, peers)
OPS_LEASE = "ops/"  # the leases of the operations endpoint's pins (an engine's are "<engine id>/...")


@dataclass
class Model:
    """The tiers of one model (engine metadata): `label` names it in stats and logs."""

    label: str
    metadata: LMCacheEngineMetadata
    storage: StorageManager
    tokens: ChunkedTokenDatabase


@dataclass
class Located:
    """The answer of an engine's `contains`: the tier holding each of `keys` (None: none does)."""

    keys: list[CacheEngineKey]
    holders: list[StorageBackendInterface | None]


@dataclass
class Engine:
    """One attached engine and everything the server holds for it."""

    engine_id: str
    name: str
    pid: int | None
    model: Model
    pidfd: int | None
    last_seen: float
    client: str | None = None  # the engine-side client that attached (it may attach again)
    reserved: dict[int, MemoryObj] = field(default_factory=dict)
    reads: dict[int, MemoryObj] = field(default_factory=dict)
    leases: set[str] = field(default_factory=set)
    counts: Counters = field(default_factory=Counters)
    silent: bool = False
    located: Located | None = None  # its last `contains` (the `lease` of a leased lookup follows it)

    def lease_id(self, lease: str) -> str:
        return f"{self.engine_id}/{lease}"


class CacheServer:
    """Serve `url` (``ipc:///path`` or ``tcp://host:port``) with an arena of `arena_bytes` and the
    lower tiers of `config`; `serve_forever()` runs the loop, `stop()` ends it, `close()` frees
    everything (and removes the arena)."""

    def __init__(self, url: str, arena_bytes: int, config: LMCacheEngineConfig | None = None,
                 heartbeat: float = 1.0) -> None:
        """With `config.kv_events_endpoint`, the tiers' KV events are published there (`kv_events`)."""
        if heartbeat <= 0:
            raise ValueError(f"heartbeat must be > 0 seconds, got {heartbeat}")
        self.config = dataclasses.replace(config or LMCacheEngineConfig(), local_cpu=True,
                                          cache_server_url=None)
        self.heartbeat = heartbeat
        self.session = uuid.uuid4().hex
        self.started = time.time()
        self.lock = threading.RLock()  # the state below, shared with the HTTP threads
        self.models: dict[str, Model] = {}
        self.engines: dict[str, Engine] = {}
        self.counts = Counters()
        self._ids = itertools.count(1)
        self._stopping = threading.Event()
        self._url_lock = _claim(url)
        self._zmq = zmq.Context()
        self.socket = self._zmq.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._answers = self._zmq.socket(zmq.PULL)  # what the I/O workers answered, to send
        self._answers.bind(f"inproc://answers-{self.session}")
        self._pushers: list[zmq.Socket] = []
        self._pusher = threading.local()
        self._io = ThreadPoolExecutor(IO_WORKERS, thread_name_prefix="lmcache-server-io")
        self.kv_events: ServerEvents | None = None
        try:
            if self.config.kv_events_endpoint is not None:
                self.kv_events = ServerEvents(self.config.kv_events_endpoint, self._event_sources)
            self.socket.bind(url)
            self.url = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
            for name in remove_stale():
                logger.info("removed the shared arena %s of a cache server that died", name)
            self.arena = SharedArena.create(arena_bytes)
        except BaseException:
            self._io.shutdown()
            if self.kv_events is not None:
                self.kv_events.close()
            self.socket.close()
            self._answers.close()
            self._zmq.term()
            if self._url_lock is not None:
                os.close(self._url_lock)
            raise
        self._arena_base = self.arena.tensor.data_ptr()
        self.allocator = MixedMemoryAllocator(arena_bytes, TensorMemoryAllocator(self.arena.tensor,
                                                                                 grow_bytes=GROW_BYTES))
        self.eviction: EvictionDomain[Any] = EvictionDomain(self.config.cache_policy)
        self._handlers: dict[str, Callable[[Engine, dict[str, Any]], dict[str, Any] | None]] = {
            "heartbeat": lambda engine, msg: {"grown": self.allocator.pin_allocator.grown},
            "contains": self._contains, "lease": self._lease,
            "unlease": self._unlease, "reserve": self._reserve, "commit": self._commit,
            "abort": self._abort, "get": self._get, "release": self._release, "bye": self._bye,
        }
        assert set(self._handlers) | {"hello"} == m.OPS, "every op of the protocol has a handler"
        logger.info("LMCache cache server on %s: L1 arena %s (%.2f GB), session %s", self.url,
                    self.arena.name, arena_bytes / (1 << 30), self.session)

    # ---- the loop -------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._answers, zmq.POLLIN)
        watched: dict[int, str] = {}
        check_every = self.heartbeat / 4  # for silent engines
        next_check = time.monotonic()
        while not self._stopping.is_set():
            current = {e.pidfd: e.engine_id for e in self.engines.values() if e.pidfd is not None}
            for fd in [fd for fd, engine_id in watched.items() if current.get(fd) != engine_id]:
                poller.unregister(fd)
                del watched[fd]
            for fd, engine_id in current.items():
                if fd not in watched:
                    poller.register(fd, zmq.POLLIN)
                    watched[fd] = engine_id
            # at most STOP_CHECK, so that a stop (SIGTERM's handler runs while the poll waits, and
            # the poll goes on) is seen soon
            ready = dict(poller.poll(timeout=max(1, int(min(check_every, STOP_CHECK) * 1000))))
            if self.socket in ready:
                for _ in range(256):  # what has arrived, then the rest of the loop
                    try:
                        frames = self.socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._serve(frames)
            if self._answers in ready:
                while True:
                    try:
                        self.socket.send_multipart(self._answers.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            for fd, engine_id in list(watched.items()):
                if fd in ready and engine_id in self.engines:
                    with self.lock:
                        self._reap(self.engines[engine_id], "its process exited")
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + check_every
                self._check_silent()

    def stop(self) -> None:
        self._stopping.set()

    def _serve(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return  # ZMQ always gives the sender's identity first; nothing to answer to
        identity, body = frames[0], frames[1:]
        request_id = None
        try:
            msg = m.decode(body)
            request_id = msg.get("id")
            with self.lock:
                engine = self._engine_of(msg)
                if engine is not None and msg["op"] in IO_OPS and engine.model.storage.lower:
                    self._io.submit(self._serve_io, identity, msg, engine)  # may wait on a lower tier
                    return
                reply = self._handle(msg, engine)
        except BadMessage as e:
            self.counts.add("bad_messages")
            logger.debug("bad request: %s", e)
            reply = m.error(request_id, str(e), e.code)
        except Exception as e:
            self.counts.add("errors")
            logger.exception("cache server: a request failed")
            reply = m.error(request_id, f"internal error: {type(e).__name__}: {e}", "internal")
        if reply is not None:
            self.socket.send_multipart([identity, m.encode(reply)])

    def _engine_of(self, msg: dict[str, Any]) -> Engine | None:
        """The attached engine a request (but ``hello``) comes from, now heard from; BadMessage if
        it names another session or an engine the server does not know."""
        if msg["op"] == "hello":
            return None
        if m.str_field(msg, "session") != self.session:
            raise BadMessage("this cache server restarted since the engine attached: attach again", "session")
        engine = self.engines.get(m.str_field(msg, "engine"))
        if engine is None:
            raise BadMessage("unknown engine (it left or was reaped): attach again", "engine")
        engine.last_seen = time.monotonic()
        if engine.silent:
            engine.silent = False
            logger.info("engine %s (%s) is heard from again", engine.engine_id, engine.name)
        return engine

    def _handle(self, msg: dict[str, Any], engine: Engine | None) -> dict[str, Any] | None:
        op = msg["op"]
        if engine is None:
            return {"ok": True, "id": msg.get("id"), **self._hello(msg)}
        out = self._handlers[op](engine, msg)
        if "id" not in msg or op in m.NOTIFICATIONS:
            return None
        return {"ok": True, "id": msg["id"], **(out or {})}

    def _serve_io(self, identity: bytes, msg: dict[str, Any], engine: Engine) -> None:
        """A request that may wait on a lower tier, on an I/O worker: the loop serves the other
        engines meanwhile (handlers take the lock for what they change)."""
        request_id = msg.get("id")
        try:
            reply: dict[str, Any] = {"ok": True, "id": request_id,
                                     **(self._handlers[msg["op"]](engine, msg) or {})}
        except BadMessage as e:
            self.counts.add("bad_messages")
            reply = m.error(request_id, str(e), e.code)
        except Exception as e:
            self.counts.add("errors")
            logger.exception("cache server: a request failed")
            reply = m.error(request_id, f"internal error: {type(e).__name__}: {e}", "internal")
        if "id" not in msg:
            return
        sock = getattr(self._pusher, "socket", None)
        if sock is None:
            sock = self._pusher.socket = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"inproc://answers-{self.session}")
            with self.lock:
                self._pushers.append(sock)
        sock.send_multipart([identity, m.encode(reply)])

    # ---- attach / detach ------------------------------------------------------------------------

    def _hello(self, msg: dict[str, Any]) -> dict[str, Any]:
        metadata = m.metadata_field(msg)
        name = m.str_field(msg, "name", 256)
        pid = msg.get("pid")
        if pid is not None and not (isinstance(pid, int) and not isinstance(pid, bool) and pid > 0):
            raise BadMessage(f"hello: 'pid' must be an int > 0 or null, got {pid!r}")
        client = msg.get("client")
        if client is not None and not (isinstance(client, str) and 0 < len(client) <= 64):
            raise BadMessage(f"hello: 'client' must be a string of 1..64 characters, got {client!r}")
        for old in [e for e in self.engines.values() if client is not None and e.client == client]:
            if not old.reserved and not old.reads:  # e.g. a hello whose answer came too late
                self._reap(old, "its client attached again")
        model = self._model(metadata)
        engine = Engine(uuid.uuid4().hex[:16], name, pid, model, _pidfd(pid), time.monotonic(), client)
        self.engines[engine.engine_id] = engine
        self.counts.add("engines_attached")
        logger.info("engine %s attached: %s, pid %s, model %s%s", engine.engine_id, name, pid, model.label,
                    "" if engine.pidfd is not None else " (its process cannot be watched: heartbeats only)")
        return {"session": self.session, "engine": engine.engine_id, "arena": self.arena.name,
                "arena_size": self.arena.size, "heartbeat": self.heartbeat,
                "grown": self.allocator.pin_allocator.grown, "texts": self.kv_events is not None}

    def _model(self, metadata: LMCacheEngineMetadata) -> Model:
        wire = m.encode(m.metadata_to_wire(metadata))
        label = f"{metadata.model_name}:{metadata.worker_id}/{metadata.world_size}:" \
                f"{hashlib.sha256(wire).hexdigest()[:8]}"
        model = self.models.get(label)
        if model is None:
            config = dataclasses.replace(self.config, chunk_size=metadata.kv_shape[2])
            if config.local_disk is not None:  # one directory per model: its own index and size
                folder = label.replace("/", "_").replace(":", "_")
                config = dataclasses.replace(config, local_disk=str(Path(config.local_disk) / folder))
            storage = StorageManager(config, metadata, self.allocator, eviction=self.eviction)
            if self.kv_events is not None:
                storage.publish_events()
            tokens = ChunkedTokenDatabase(config, metadata)
            model = self.models[label] = Model(label, metadata, storage, tokens)
        return model

    def _bye(self, engine: Engine, msg: dict[str, Any]) -> None:
        self._reap(engine, "it left")

    def _reap(self, engine: Engine, why: str) -> None:
        """Give back everything `engine` holds and forget it."""
        if self.engines.pop(engine.engine_id, None) is None:
            return
        sm = engine.model.storage
        for lease in engine.leases:
            sm.release_lease(engine.lease_id(lease))
        for obj in [*engine.reserved.values(), *engine.reads.values()]:
            obj.ref_count_down()
        if engine.pidfd is not None:
            os.close(engine.pidfd)
        self.counts.add("engines_reaped" if why != "it left" else "engines_left")
        logger.info("engine %s (%s) detached: %s; %d slots, %d reads and %d leases given back",
                    engine.engine_id, engine.name, why, len(engine.reserved), len(engine.reads),
                    len(engine.leases))

    def _check_silent(self) -> None:
        limit = MISSED_HEARTBEATS * self.heartbeat
        now = time.monotonic()
        with self.lock:
            for engine in list(self.engines.values()):
                if now - engine.last_seen <= limit:
                    continue
                if engine.pidfd is None or engine.pid is None or not process_alive(engine.pid):
                    self._reap(engine, f"no heartbeat for {now - engine.last_seen:.1f} s")
                elif not engine.silent:
                    engine.silent = True
                    for lease in engine.leases:
                        engine.model.storage.release_lease(engine.lease_id(lease))
                    engine.leases.clear()
                    logger.warning("engine %s (%s) silent for %.1f s but its process is alive: its "
                                   "leases end; its %d slots and %d reads stay held while it lives",
                                   engine.engine_id, engine.name, now - engine.last_seen,
                                   len(engine.reserved), len(engine.reads))

    # ---- requests -------------------------------------------------------------------------------

    def _contains(self, engine: Engine, msg: dict[str, Any]) -> dict[str, Any]:
        keys = m.keys_field(msg)
        located = engine.located = Located(keys, engine.model.storage.locate(keys))
        return {"hits": [t is not None for t in located.holders]}

    def _lease(self, engine: Engine, msg: dict[str, Any]) -> dict[str, Any]:
        keys, lease, ttl = m.keys_field(msg), m.str_field(msg, "lease"), m.seconds_field(msg, "ttl")
        sm = engine.model.storage
        lookup = _leased_prefix(engine, keys)
        with self.lock:
            if self.engines.get(engine.engine_id) is not engine:
                raise BadMessage("the engine was reaped meanwhile: attach again", "engine")
            sm.acquire_lease(engine.lease_id(lease), keys[: lookup.hits], ttl)
            engine.leases.add(lease)
        sm.prefetch(lookup)
        return {"hits": lookup.hits}

    def _unlease(self, engine: Engine, msg: dict[str, Any]) -> None:
        lease = m.str_field(msg, "lease")
        engine.model.storage.release_lease(engine.lease_id(lease))
        engine.leases.discard(lease)

    def _reserve(self, engine: Engine, msg: dict[str, Any]) -> dict[str, Any]:
        dtype = m.dtype_field(msg)
        shapes = m.shapes_field(msg, dtype, self.arena.size)
        slots = []
        for obj in engine.model.storage.allocate_many(shapes, dtype, MemoryFormat.KV_BLOB):
            slot = next(self._ids)
            engine.reserved[slot] = obj
            slots.append([slot, self._offset(obj)])
        engine.counts.add("reserved", len(slots))
        if len(slots) < len(shapes):
            engine.counts.add("reserve_full", len(shapes) - len(slots))
        return {"slots": slots}

    def _commit(self, engine: Engine, msg: dict[str, Any]) -> None:
        slots, keys = m.int_list(msg, "slots"), m.keys_field(msg)
        texts = m.texts_field(msg, len(keys))
        named = set(slots)
        if len(slots) != len(keys) or len(named) != len(slots) or not named <= engine.reserved.keys():
            raise BadMessage(f"commit: {len(slots)} slots (each named once, held by the engine?) "
                             f"for {len(keys)} keys")
        objs = [engine.reserved.pop(s) for s in slots]
        if texts is not None and self.kv_events is not None:
            self.kv_events.texts.add(keys, texts)  # before the tiers' events are taken
        try:
            engine.model.storage.put_many(keys, objs)
        finally:
            release_all(objs)
        engine.counts.add("committed", len(objs))
        engine.counts.add("bytes_stored", sum(obj.get_size() for obj in objs))

    def _abort(self, engine: Engine, msg: dict[str, Any]) -> None:
        for slot in m.int_list(msg, "slots"):
            obj = engine.reserved.pop(slot, None)
            if obj is not None:
                obj.ref_count_down()
                engine.counts.add("aborted")

    def _get(self, engine: Engine, msg: dict[str, Any]) -> dict[str, Any]:
        objs = engine.model.storage.get_prefix(m.keys_field(msg))
        with self.lock:
            if self.engines.get(engine.engine_id) is not engine:
                release_all(objs)
                raise BadMessage("the engine was reaped meanwhile: attach again", "engine")
            return self._hand_out(engine, objs)

    def _hand_out(self, engine: Engine, objs: list[MemoryObj]) -> dict[str, Any]:
        """Hold `objs` (the lock held) for `engine` until it releases them; their offsets."""
        out: list[list[Any]] = []
        for i, obj in enumerate(objs):
            offset = self._offset(obj)
            if offset is None:  # not in the arena (cannot be handed out): the prefix ends here
                for rest in objs[i:]:
                    rest.ref_count_down()
                break
            read = next(self._ids)
            engine.reads[read] = obj
            out.append([read, offset, list(obj.get_shape()), dtype_tag(obj.get_dtype())])
            engine.counts.add("bytes_read", obj.get_size())
        engine.counts.add("gets")
        engine.counts.add("chunks_read", len(out))
        return {"objs": out}

    def _release(self, engine: Engine, msg: dict[str, Any]) -> None:
        for read in m.int_list(msg, "reads"):
            obj = engine.reads.pop(read, None)
            if obj is not None:
                obj.ref_count_down()

    def _offset(self, obj: MemoryObj) -> int | None:
        """Where `obj`'s bytes start in the arena (None: they are not in it)."""
        tensor = obj.tensor
        if tensor is None:
            return None
        offset = tensor.data_ptr() - self._arena_base
        return offset if 0 <= offset and offset + obj.get_size() <= self.arena.size else None

    # ---- operations -----------------------------------------------------------------------------

    def _models(self) -> list[Model]:
        """The models served so far: operations wait on their tiers without the lock."""
        with self.lock:
            return list(self.models.values())

    def _event_sources(self) -> list[tuple[StorageManager, int]]:
        return [(model.storage, model.tokens.chunk_size) for model in self._models()]

    def health(self) -> dict[str, Any]:
        tiers = {model.label: model.storage.health() for model in self._models()}
        ok = all(all(t.values()) for t in tiers.values())
        return {"status": "ok" if ok else "degraded", "session": self.session, "tiers": tiers}

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        alloc = self.allocator.pin_allocator
        with self.lock:
            engines = {e.engine_id: {
                "name": e.name, "pid": e.pid, "model": e.model.label, "watched": e.pidfd is not None,
                "seconds_since_heard": round(now - e.last_seen, 3), "slots_reserved": len(e.reserved),
                "reads_held": len(e.reads), "leases": len(e.leases), **e.counts.snapshot()}
                for e in self.engines.values()}
        models = {label: {tier: {**s.counters, **s.gauges} for tier, s in tiers.items()}
                  for label, tiers in self.tier_stats().items()}
        arena = {"name": self.arena.name, "bytes": self.arena.size, "grown_bytes": alloc.grown,
                 "resident_bytes": self.arena.resident_bytes(), "used_bytes": alloc.used_bytes}
        return {"session": self.session, "uptime_s": round(time.time() - self.started, 1), "url": self.url,
                "heartbeat_s": self.heartbeat, "arena": arena, "engines": engines, "models": models,
                "server": self.counts.snapshot()}

    def tier_stats(self) -> dict[str, dict[str, TierStats]]:
        """Each model's tiers' counters and gauges."""
        return {model.label: model.storage.stats() for model in self._models()}

    def lookup(self, tokens: torch.Tensor, extra_key: str | None = None) -> dict[str, Any]:
        """For each model: how many prefix tokens of `tokens` are cached, in any tier and per tier."""
        return {model.label: _cached(model, tokens, extra_key) for model in self._models()}

    def clear(self, which: str) -> dict[str, dict[str, int]]:
        return {model.label: model.storage.clear(which) for model in self._models()}

    def pin(self, tokens: torch.Tensor, extra_key: str | None, lease: str, ttl: float) -> dict[str, int]:
        """For each model: keep the cached prefix of `tokens` cached (in whichever tier holds it;
        lower-tier chunks are brought into L1) until `unpin(lease)` or `ttl` seconds; how many
        tokens that is. Pinning the same lease again replaces what it pins."""
        pinned = {}
        for model in self._models():
            chunks = _chunks(model, tokens, extra_key)
            keys = [c.key for c in chunks]
            lookup = model.storage.contains_prefix(keys)
            model.storage.acquire_lease(OPS_LEASE + lease, keys[: lookup.hits], ttl)
            model.storage.prefetch(lookup)
            pinned[model.label] = _prefix_tokens(chunks, lookup.hits)
        return pinned

    def unpin(self, lease: str) -> None:
        for model in self._models():
            model.storage.release_lease(OPS_LEASE + lease)

    def close(self) -> None:
        """Give back everything, close the tiers, the socket and the arena (removed)."""
        self.stop()
        self._io.shutdown(wait=True)
        if self.kv_events is not None:
            self.kv_events.close()
        with self.lock:
            for engine in list(self.engines.values()):
                self._reap(engine, "the server stops")
            for model in self.models.values():
                model.storage.close()
            self.models.clear()
        for sock in [*self._pushers, self.socket, self._answers]:
            sock.close(0)
        self._zmq.term()
        self.allocator.close()
        self.arena.close()
        if self._url_lock is not None:  # an ipc:// socket: its file and lock file go too
            path = self.url[len("ipc://"):]
            Path(path).unlink(missing_ok=True)
            Path(f"{path}.lock").unlink(missing_ok=True)
            os.close(self._url_lock)


def _chunks(model: Model, tokens: torch.Tensor, extra_key: str | None) -> list[ChunkSpan]:
    return list(model.tokens.process_tokens(tokens, extra_key=extra_key))


def _prefix_tokens(chunks: list[ChunkSpan], hits: int) -> int:
    """How many tokens the first `hits` of `chunks` cover."""
    return chunks[hits - 1].end if hits else 0


def _leased_prefix(engine: Engine, keys: list[CacheEngineKey]) -> PrefixLookup:
    """The cached prefix `keys` are (a lease names the prefix the engine counted): where the
    engine's last `contains` found them when it asked about them (an engine's leased lookup is a
    `contains` and then a `lease` of the prefix it counted), else asked of the tiers."""
    located, engine.located = engine.located, None
    if located is None or located.keys[: len(keys)] != keys:
        return engine.model.storage.contains_prefix(keys)
    lookup = PrefixLookup(keys)
    for holder in located.holders[: len(keys)]:
        if holder is None:
            break
        lookup.tiers.append(holder)
    return lookup


def _cached(model: Model, tokens: torch.Tensor, extra_key: str | None) -> dict[str, Any]:
    chunks = _chunks(model, tokens, extra_key)
    keys = [c.key for c in chunks]

    def prefix(search_range: str | None) -> int:
        return _prefix_tokens(chunks, model.storage.contains_prefix(keys, search_range).hits)

    return {"cached_tokens": prefix(None), "tiers": {t.name: prefix(t.name) for t in model.storage.tiers}}


def _pidfd(pid: int | None) -> int | None:
    """A pidfd that becomes readable when process `pid` exits (None: not visible from here)."""
    if pid is None:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _claim(url: str) -> int | None:
    """For ``ipc://path``: hold ``path.lock`` (flock) while serving, so a second server on the same
    socket fails clearly instead of taking it over (a SIGKILLed server's lock goes with it)."""
    if not url.startswith("ipc://"):
        return None
    path = url[len("ipc://"):]
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"another LMCache cache server serves {url}") from None
    return fd
