"""`LMCacheEngine`: store, retrieve, look up and prefetch KV by token prefix.

Everything works on whole requests: one storage-manager call per tier and one connector copy per
store or retrieve, never a loop over chunks.

Store: tokens -> chunk keys -> skip chunks a local tier already holds -> a buffer per new chunk
from the CPU arena (evicting if needed; if nothing can be freed, store fewer chunks) -> one
connector copy of all of them -> once the copy has completed, the storage manager keeps them (hot
tier now, lower tiers asynchronously).
Retrieve: tokens -> keys -> the storage manager's longest cached prefix (hot hits, loads in
flight, one batched get per lower tier; promoted to hot; an object not of the connector's shape and
the KV dtype ends it, a miss) -> one connector copy into the engine -> a CPU bool mask of the
tokens retrieved.
Lookup: how many prefix tokens are cached (one batched existence check per tier); with a lease,
every counted chunk is pinned in whichever tier holds it and the non-hot ones start loading.
Recurrent states (hybrid models, `metadata.state_layout`): `store_state` keeps the state after
exactly a prefix's tokens beside the prefix's last chunk (its key under the state layout),
`retrieve_state` gives it back, and a lookup counts only up to the last boundary whose state is
held (a hit must resume every layer).

Failures follow `lmcache.failures`: a tier fault is a miss inside the storage manager and never
reaches the engine; `error_handling` decides what an unexpected error (a bug) inside store or
retrieve does: with True it is logged and counted (``errors``) and the call returns as a miss (a
failed retrieve reports nothing retrieved: the copy may have written any part of the range), with
False it propagates. Bad input (mask shape, search_range names) always raises ValueError.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.chunk_hash import ChunkText
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.controller import Controller
from lmcache.failures import BugsAsMisses
from lmcache.gpu_connector import CopyDone, GPUConnectorInterface
from lmcache.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MixedMemoryAllocator,
    release_all,
)
from lmcache.metrics import MetricsServer
from lmcache.observability import CapacityLog, EngineStats, log_once
from lmcache.storage_backend.storage_manager import PrefixLookup, StorageManager
from lmcache.token_database import ChunkedTokenDatabase, ChunkSpan, TokenDatabase

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT = 30.0


class CopiesInFlight:
    """The connector copies an engine has issued and not yet seen complete (see `CopyDone`), and
    the keys they are storing (a second store of such a key skips it)."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._count = 0
        self._keys: set[CacheEngineKey] = set()

    def storing(self, key: CacheEngineKey) -> bool:
        return key in self._keys

    def start(self, keys: list[CacheEngineKey], then: CopyDone) -> InFlightCopy:
        with self._idle:
            self._count += 1
            self._keys.update(keys)
        return InFlightCopy(self, keys, then)

    def _end(self, keys: list[CacheEngineKey]) -> None:
        with self._idle:
            self._count -= 1
            self._keys.difference_update(keys)
            self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._count == 0, timeout)


class InFlightCopy:
    """One issued copy: called (as the connector's `on_done`) when it completes, or `abort()`ed
    if the connector raised instead. Only the first of those counts (a connector that reported
    completion and then raised anyway cannot make the engine release memory twice)."""

    def __init__(self, table: CopiesInFlight, keys: list[CacheEngineKey], then: CopyDone) -> None:
        self._table, self._keys, self._then = table, keys, then
        self._lock = threading.Lock()
        self._ended = False

    def _claim(self) -> bool:
        with self._lock:
            ended, self._ended = self._ended, True
        return not ended

    def __call__(self, error: BaseException | None) -> None:
        if not self._claim():
            return
        try:
            self._then(error)
        finally:
            self._table._end(self._keys)

    def abort(self) -> bool:
        """End the copy without running `then`; False if it had completed already."""
        if not self._claim():
            return False
        self._table._end(self._keys)
        return True


@dataclass
class ChunkCopy:
    """One chunk on its way between the engine's KV and an arena object."""

    chunk: ChunkSpan
    obj: MemoryObj
    text: ChunkText | None = None  # on the way into the tiers

    @staticmethod
    def columns(copies: list[ChunkCopy]) -> tuple[list[MemoryObj], list[int], list[int]]:
        """The objects, starts and ends of `copies`: a connector's batched call's arguments."""
        return [c.obj for c in copies], [c.chunk.start for c in copies], [c.chunk.end for c in copies]


class LMCacheEngine:
    def __init__(
        self,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata,
        memory_allocator: MemoryAllocatorInterface,
        token_database: TokenDatabase,
        gpu_connector: GPUConnectorInterface,
    ) -> None:
        if metadata.kv_shape[2] != config.chunk_size:
            raise ValueError(f"metadata.kv_shape chunk size {metadata.kv_shape[2]} differs from "
                             f"config.chunk_size={config.chunk_size}")
        self.config = config
        self.metadata = metadata
        self.memory_allocator = memory_allocator
        self.token_database = token_database
        self.gpu_connector = gpu_connector
        self.storage_manager = StorageManager(config, metadata, memory_allocator)
        self.stats = EngineStats(self.storage_manager.stats)
        self.bugs = BugsAsMisses(logger, "LMCache engine", config.error_handling,
                                 lambda: self.stats.add("errors"))
        self._bytes_per_token = (metadata.kv_count * metadata.num_layers * metadata.hidden_dim
                                 * metadata.kv_dtype.itemsize)
        self._copies = CopiesInFlight()
        self._closed = False
        self._arena_full = CapacityLog(logger, "stores found the CPU arena full of KV in use and kept "
                                       "fewer chunks:", "tokens not stored, in store_dropped_tokens")
        self.controller: Controller | None = None
        self.metrics_server: MetricsServer | None = None
        try:
            if config.controller_url is not None:
                self.controller = self._start_controller(config.controller_url)
            if config.metrics_port is not None:
                self.metrics_server = self._start_metrics(config.metrics_host, config.metrics_port)
        except BaseException:
            self.close()
            raise

    def _start_metrics(self, host: str, port: int) -> MetricsServer:
        """Prometheus metrics on `host:port` (tensor-parallel rank r on port + r)."""
        port_no = port + max(self.metadata.worker_id, 0) if port else 0
        try:
            return MetricsServer(self.stats, host, port_no)
        except OSError as e:
            raise ValueError(f"metrics_port {port}: cannot listen on {host}:{port_no}: {e}") from e

    def _start_controller(self, url: str) -> Controller:
        """The HTTP controller at `url` (tensor-parallel rank r listens on port + r)."""
        host, _, port = url.rpartition(":")
        port_no = int(port) + max(self.metadata.worker_id, 0) if int(port) else 0
        try:
            return Controller(self, host, port_no)
        except OSError as e:
            raise ValueError(f"controller_url {url!r}: cannot listen on {host}:{port_no}: {e}") from e

    # ---- store ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def store(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, *,
              extra_key: str | None = None, **kwargs: Any) -> None:
        """Store the KV of `tokens` (where `mask` is True) that is not cached yet. `kwargs` go to
        the connector (e.g. ``kvcaches``, ``slot_mapping``). Raises ValueError for a bad mask."""
        t0 = time.perf_counter()
        chunks = list(self.token_database.process_tokens(tokens, mask, extra_key=extra_key))
        self.stats.add("store_requests")
        copied = self.bugs.call("store", partial(self._store_chunks, chunks, kwargs,
                                                 partial(self._chunk_texts, tokens, chunks, extra_key)), 0)
        self._observe("store", time.perf_counter() - t0, copied)

    def _chunk_texts(self, tokens: torch.Tensor, chunks: list[ChunkSpan], extra_key: str | None,
                     new: list[ChunkSpan]) -> list[ChunkText]:
        """The text of each of `new` (some of `chunks`, the chunks of `tokens` a store got)."""
        digest_ending = {c.end: c.key.chunk_hash for c in chunks}
        if new and new[0].start > 0 and new[0].start not in digest_ending:  # a masked prefix
            *_, before = self.token_database.process_tokens(tokens[: new[0].start], extra_key=extra_key)
            digest_ending[before.end] = before.key.chunk_hash
        ids = tokens.detach().to("cpu", torch.int64).numpy().copy()  # the caller may reuse `tokens`
        return [ChunkText(digest_ending.get(c.start), ids[c.start : c.end]) for c in new]

    def _store_chunks(self, chunks: list[ChunkSpan], kwargs: dict[str, Any],
                      texts_of: Callable[[list[ChunkSpan]], list[ChunkText]]) -> int:
        """Issue the copy of the chunks not cached yet; returns how many tokens it copies.
        `texts_of(chunks)`: their texts, for the tiers that take them."""
        sm = self.storage_manager
        cached = sm.stored_locally([c.key for c in chunks])
        new: list[ChunkSpan] = []
        for chunk, hit in zip(chunks, cached, strict=True):
            if hit or self._copies.storing(chunk.key):
                self.stats.add("store_skipped_tokens", chunk.num_tokens)
            else:
                new.append(chunk)
        texts = texts_of(new) if sm.takes_texts() else [None] * len(new)
        shapes = [self.gpu_connector.get_shape(c.num_tokens) for c in new]
        objs = sm.allocate_many(shapes, self.metadata.kv_dtype, MemoryFormat.KV_BLOB)
        todo = [ChunkCopy(chunk, obj, text) for chunk, obj, text in zip(new, objs, texts, strict=False)]
        try:
            if len(todo) < len(new):  # capacity, not a failure: counted and summarized
                dropped = sum(c.num_tokens for c in new[len(todo):])
                self.stats.add("store_dropped_tokens", dropped)
                if self.memory_allocator.available:  # else its own outage, logged where it is seen
                    self._arena_full.note(dropped)
            if not todo:
                return 0
            done = self._copies.start([c.chunk.key for c in todo], partial(self._finish_store, todo))
        except BaseException:
            release_all([c.obj for c in todo])
            raise
        try:
            self.gpu_connector.batched_from_gpu(*ChunkCopy.columns(todo), on_done=done, **kwargs)
        except BaseException:
            if done.abort():
                release_all([c.obj for c in todo])
            raise
        return sum(c.chunk.num_tokens for c in todo)

    def _finish_store(self, todo: list[ChunkCopy], error: BaseException | None) -> None:
        """The copy of `todo` has completed (or failed): the objects enter the tiers."""
        try:
            if error is None:
                self.storage_manager.put_many([c.chunk.key for c in todo], [c.obj for c in todo],
                                              [c.text for c in todo])
                self.stats.add("stored_tokens", sum(c.chunk.num_tokens for c in todo))
        finally:
            release_all([c.obj for c in todo])
        if error is not None:
            self.bugs.failed("asynchronous store copy", error)

    # ---- retrieve -------------------------------------------------------------------------------

    @torch.inference_mode()
    def retrieve(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, *,
                 extra_key: str | None = None, **kwargs: Any) -> torch.Tensor:
        """Load the longest cached prefix of `tokens` (from the first True of `mask`) into the
        engine; return a CPU bool mask of the tokens retrieved. The copy may still be in flight on
        the engine's device stream when this returns (ordered before the caller's later work)."""
        t0 = time.perf_counter()
        chunks = list(self.token_database.process_tokens(tokens, mask, extra_key=extra_key))
        ret_mask = torch.zeros(tokens.shape[0], dtype=torch.bool)
        self.stats.add("retrieve_requests")
        self.stats.add("retrieve_requested_tokens", sum(c.num_tokens for c in chunks))
        hits: list[ChunkSpan] = self.bugs.call("retrieve", partial(self._retrieve_chunks, chunks, kwargs), [])
        for chunk in hits:
            ret_mask[chunk.start:chunk.end] = True
        self.stats.add("retrieve_hit_tokens", sum(c.num_tokens for c in hits))
        self._observe("retrieve", time.perf_counter() - t0, int(ret_mask.sum()))
        return ret_mask

    def _retrieve_chunks(self, chunks: list[ChunkSpan], kwargs: dict[str, Any]) -> list[ChunkSpan]:
        """Issue the copy of the longest cached prefix of `chunks` into the engine; returns the
        chunks it loads."""
        found: list[ChunkCopy] = []
        done: InFlightCopy | None = None
        try:
            objs = self.storage_manager.get_prefix([c.key for c in chunks])
            found = [ChunkCopy(c, obj) for c, obj in zip(chunks, objs, strict=False)]
            fit = next((i for i, c in enumerate(found) if not self._holds_kv(c)), len(found))
            release_all([c.obj for c in found[fit:]])
            found = found[:fit]
            if found:
                done = self._copies.start([], partial(self._finish_retrieve, [c.obj for c in found]))
                self.gpu_connector.batched_to_gpu(*ChunkCopy.columns(found), on_done=done, **kwargs)
        except BaseException:
            if done is None or done.abort():
                release_all([c.obj for c in found])
            raise
        return [c.chunk for c in found]

    def _holds_kv(self, copy: ChunkCopy) -> bool:
        """Whether `copy.obj` holds its chunk's KV as this engine's connector lays it out; a tier's
        object that does not (an intact blob of another layout or writer) is a miss, logged once."""
        shape, dtype = copy.obj.get_shape(), copy.obj.get_dtype()
        expected = self.gpu_connector.get_shape(copy.chunk.num_tokens)
        if tuple(shape) == tuple(expected) and dtype == self.metadata.kv_dtype:
            return True
        log_once(logger, "misfit chunk", "a tier returned a chunk of %s %s where the engine expects %s "
                 "%s (another layout or writer?): treated as a miss", dtype, tuple(shape),
                 self.metadata.kv_dtype, tuple(expected))
        return False

    def _finish_retrieve(self, objs: list[MemoryObj], error: BaseException | None) -> None:
        """The copy into the engine has completed (or failed): the objects may go."""
        release_all(objs)
        if error is not None:
            self.bugs.failed("asynchronous retrieve copy", error)

    def _observe(self, op: str, seconds: float, tokens: int) -> None:
        self.stats.add_time(f"{op}_s", seconds)
        self.stats.observe(f"{op}_seconds", seconds)
        if tokens and seconds > 0:
            self.stats.observe(f"{op}_gbps", tokens * self._bytes_per_token / seconds / 1e9)

    # ---- lookup / prefetch ----------------------------------------------------------------------

    def lookup(self, tokens: torch.Tensor, search_range: str | list[str] | None = None, *,
               extra_key: str | None = None, lease_id: str | None = None,
               lease_ttl: float = 60.0, state_ends: Iterable[int] = (), count: bool = True) -> int:
        """How many prefix tokens of `tokens` are cached in the tiers named by `search_range`
        (one name, or a subset of "Hot" (alias "LocalCPUBackend"), "LocalDiskBackend",
        "RemoteBackend", "PeerBackend" (alias "P2PBackend"); None = all; ValueError for an
        unknown name). A chunk whose write to a
        lower tier is still in flight counts (a prefetch or retrieve uses the object being
        written).

        With `lease_id`, every chunk counted is pinned in whichever tier holds it (not evicted)
        until `release(lease_id)` or `lease_ttl` seconds, and those not in the hot tier start
        loading into it, so that a retrieve soon after finds what the lookup counted.

        A hybrid model's count (`metadata.state_layout`) ends at the last boundary whose
        recurrent state is held: the end of a full chunk, or one of `state_ends` (token counts
        within `tokens` where the serving engine may have kept a state mid-chunk; the prefix up to
        it, its trailing partial chunk included, must be cached); the lease pins the state too.

        `count=False`: not added to the engine's lookup counters (an operator's question, not a
        serving engine's lookup)."""
        chunks = list(self.token_database.process_tokens(tokens, extra_key=extra_key))
        found = self.storage_manager.contains_prefix([c.key for c in chunks], search_range)
        hit = chunks[found.hits - 1].end if found.hits else 0
        pinned = [found]
        if self.metadata.state_layout:
            hit, pinned = self._resume_point(tokens, chunks, found, state_ends, extra_key, search_range)
        if lease_id is not None:
            self.storage_manager.acquire_lease(lease_id, [k for p in pinned for k in p.keys[: p.hits]],
                                               lease_ttl)
            for lookup in pinned:
                self.storage_manager.prefetch(lookup)
        if count:
            self.stats.add("lookup_requests")
            self.stats.add("lookup_hit_tokens", hit)
        return hit

    def release(self, lease_id: str) -> None:
        """End a lookup lease (see `lookup`); unknown ids are ignored."""
        self.storage_manager.release_lease(lease_id)

    def prefetch(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, *,
                 extra_key: str | None = None) -> None:
        """Start loading the cached prefix of `tokens` from lower tiers into the hot tier."""
        chunks = self.token_database.process_tokens(tokens, mask, extra_key=extra_key)
        self.storage_manager.prefetch(self.storage_manager.contains_prefix([c.key for c in chunks]))

    def held_prefix(self, tokens: torch.Tensor, *, extra_key: str | None = None,
                    state_ends: Iterable[int] = ()) -> list[tuple[CacheEngineKey, MemoryObj]]:
        """What this engine holds for the cached prefix of `tokens`, to hand to another engine
        (prefill/decode disaggregation): its chunks, in order, and for a hybrid model the
        recurrent states it holds at their ends and at `state_ends` (with the trailing partial
        chunk a mid-chunk end needs). One reference per object, owned by the caller. Waits for
        stores still being copied (bounded)."""
        self._copies.wait_idle(CLOSE_TIMEOUT)
        sm = self.storage_manager
        chunks = list(self.token_database.process_tokens(tokens, extra_key=extra_key))
        objs = sm.get_prefix([c.key for c in chunks])
        held = [(c.key, obj) for c, obj in zip(chunks, objs, strict=False)]
        if self.metadata.state_layout and objs:
            try:
                extra = [self.state_key(c.key) for c in chunks[: len(objs)]]
                cs, end_of_prefix = self.config.chunk_size, chunks[len(objs) - 1].end
                for end in sorted(set(state_ends)):
                    if end % cs and 0 < end <= end_of_prefix:
                        *_, tail = self.token_database.process_tokens(tokens[:end], extra_key=extra_key)
                        extra += [tail.key, self.state_key(tail.key)]
                for key in extra:
                    held += [(key, obj) for obj in sm.get_prefix([key])]
            except BaseException:
                release_all([obj for _, obj in held])
                raise
        return held

    # ---- recurrent states -----------------------------------------------------------------------

    def state_key(self, chunk_key: CacheEngineKey) -> CacheEngineKey:
        """The key of the state after the tokens that end with the chunk `chunk_key` names (a full
        chunk, or a prefix's trailing partial chunk)."""
        return dataclasses.replace(chunk_key, fmt=self.metadata.state_layout)

    def _resume_point(self, tokens: torch.Tensor, chunks: list[ChunkSpan],
                      found: PrefixLookup, state_ends: Iterable[int], extra_key: str | None,
                      search_range: str | list[str] | None) -> tuple[int, list[PrefixLookup]]:
        """The last boundary of the cached prefix whose state is held (0: none), and what resuming
        there needs, as lookups to pin and prefetch: the chunks up to it (with the trailing partial
        chunk of a mid-chunk boundary) and the state."""
        cs = self.config.chunk_size
        full = 0
        while full < found.hits and chunks[full].num_tokens == cs:
            full += 1
        # (boundary, key of its chunk, whether that chunk is a mid-chunk prefix's trailing one)
        candidates = [(chunks[i].end, chunks[i].key, False) for i in range(full)]
        for end in sorted(set(state_ends)):
            if end % cs and 0 < end <= tokens.shape[0] and end // cs <= full:
                *_, tail = self.token_database.process_tokens(tokens[:end], extra_key=extra_key)
                candidates.append((end, tail.key, True))
        state_keys = [self.state_key(key) for _, key, _ in candidates]
        tails = [key for _, key, is_tail in candidates if is_tail]
        tier_of = dict(zip(state_keys + tails, self.storage_manager.locate(state_keys + tails, search_range),
                           strict=True))
        for (end, key, is_tail), state in sorted(zip(candidates, state_keys, strict=True), reverse=True,
                                                 key=lambda c: c[0][0]):
            state_tier, chunk_tier = tier_of[state], tier_of[key] if is_tail else None
            if state_tier is None or (is_tail and chunk_tier is None):
                continue
            pins = [PrefixLookup(found.keys, found.tiers[: end // cs]), PrefixLookup([state], [state_tier])]
            if chunk_tier is not None:
                pins.append(PrefixLookup([key], [chunk_tier]))
            return end, pins
        return 0, []

    def store_state(self, tokens: torch.Tensor, nbytes: int, fill: Callable[[torch.Tensor], bool], *,
                    extra_key: str | None = None) -> bool:
        """Keep a recurrent model's state after exactly ``len(tokens)`` tokens (keyed beside the
        chunk that ends there, full or partial): `fill(buffer)` writes its `nbytes` into a uint8
        buffer from the CPU arena (stored in the KV dtype, so every serde keeps it bit for bit), or
        returns False (nothing to keep). False when not kept (held already, no room, nothing
        filled)."""
        key = self._boundary_state_key(tokens, extra_key)
        sm = self.storage_manager
        if sm.stored_locally([key])[0]:
            return False
        item = self.metadata.kv_dtype.itemsize
        obj = sm.allocate(torch.Size([-(-nbytes // item)]), self.metadata.kv_dtype, MemoryFormat.KV_BLOB)
        if obj is None:
            self.stats.add("store_dropped_states")
            return False
        try:
            buffer = obj.tensor
            assert buffer is not None
            if not fill(buffer.view(torch.uint8)[:nbytes]):
                return False
            sm.put(key, obj)
            self.stats.add("stored_states")
        finally:
            obj.ref_count_down()
        return True

    def retrieve_state(self, tokens: torch.Tensor, *, extra_key: str | None = None) -> MemoryObj | None:
        """The state stored after exactly ``len(tokens)`` tokens (one reference for the caller), or
        None."""
        got = self.storage_manager.get_prefix([self._boundary_state_key(tokens, extra_key)])
        if got:
            self.stats.add("retrieved_states")
        return got[0] if got else None

    def _boundary_state_key(self, tokens: torch.Tensor, extra_key: str | None) -> CacheEngineKey:
        if not self.metadata.state_layout:
            raise ValueError("this engine's model keeps no recurrent state (metadata.state_layout is empty)")
        if tokens.shape[0] == 0:
            raise ValueError("a state after 0 tokens is not kept")
        *_, last = self.token_database.process_tokens(tokens, extra_key=extra_key)
        return self.state_key(last.key)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the engine is at rest and its books balance: no copy in
        flight, the storage manager's checks at rest (arena, hot tier, loads; every object held by
        the hot tier alone) and every byte the arena hands out held by the hot tier: nothing leaked."""
        if not self._copies.wait_idle(0):
            raise AssertionError("copies still in flight")
        self.storage_manager.check_integrity(at_rest=True)
        hot = self.storage_manager.hot
        held = hot.stats().gauges["bytes_used"] if hot is not None else 0
        used = getattr(self.memory_allocator, "used_bytes", held)
        if used != held:
            raise AssertionError(f"the arena has {used} bytes in use, the hot tier holds {held}")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.controller is not None:
                self.controller.close()
            if self.metrics_server is not None:
                self.metrics_server.close()
            if not self._copies.wait_idle(CLOSE_TIMEOUT):
                logger.warning("KV copies still in flight after %.0f s; closing anyway", CLOSE_TIMEOUT)
            self.storage_manager.close()
            self.memory_allocator.close()


class LMCacheEngineBuilder:
    """Process-wide registry of named engines."""

    _lock = threading.Lock()
    _instances: dict[str, LMCacheEngine] = {}
    _specs: dict[str, tuple[LMCacheEngineConfig, LMCacheEngineMetadata]] = {}

    @classmethod
    def get_or_create(cls, instance_id: str, config: LMCacheEngineConfig,
                      metadata: LMCacheEngineMetadata,
                      gpu_connector: GPUConnectorInterface) -> LMCacheEngine:
        """The engine named `instance_id`, built on first use. Raises ValueError if it exists
        with a different config or metadata."""
        with cls._lock:
            if instance_id in cls._instances:
                if cls._specs[instance_id] != (config, metadata):
                    raise ValueError(f"LMCache engine {instance_id!r} already exists with a "
                                     "different configuration")
                return cls._instances[instance_id]
            allocator = _make_allocator(config, metadata)
            try:
                engine = LMCacheEngine(config, metadata, allocator, ChunkedTokenDatabase(config, metadata),
                                       gpu_connector)
            except BaseException:
                allocator.close()  # the engine did not start: nobody else will close it
                raise
            cls._instances[instance_id] = engine
            cls._specs[instance_id] = (config, metadata)
            return engine

    @classmethod
    def get(cls, instance_id: str) -> LMCacheEngine | None:
        return cls._instances.get(instance_id)

    @classmethod
    def destroy(cls, instance_id: str) -> None:
        with cls._lock:
            engine = cls._instances.pop(instance_id, None)
            cls._specs.pop(instance_id, None)
        if engine is not None:
            engine.close()

    @classmethod
    def instance_ids(cls) -> Iterable[str]:
        return list(cls._instances)


def _make_allocator(config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata) -> MemoryAllocatorInterface:
    """The engine's CPU arena; on a cache server, the server's shared arena (its client)."""
    if config.cache_server_url is not None:
        from lmcache.cache_server.client import CacheServerClient

        return CacheServerClient(config.cache_server_url, metadata, config.remote_timeout)
    size = config.max_local_cpu_bytes
    if size <= 0:
        raise ValueError(f"max_local_cpu_size={config.max_local_cpu_size} GB: the CPU arena stages "
                         "every chunk (also without the hot tier) and must be > 0")
    return MixedMemoryAllocator(size)
