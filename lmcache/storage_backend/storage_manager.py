"""`StorageManager`: one face over the tiers, working on whole prefixes, never chunk by chunk.

The tiers come from the registry (`registry.create_tiers`), in lookup order: the hot tier (CPU
memory), then the lower tiers (disk, remote, ...). Every call into a tier that `may_fail` is
guarded by the tier's failure domain (`lmcache.failures`): its failure is a miss, counted in the
tier's ``failures``, logged once per incident, and the tier is backed off from until a retry works.

- `allocate`: a buffer for a new chunk from the engine's CPU arena, evicting from the hot tier.
- `allocate_many(shapes, ...)`: buffers for several chunks at once (as many as fit, in order).
- `put(key, obj)` / `put_many(keys, objs, texts)`: the hot tier keeps the objects synchronously;
  lower tiers get them asynchronously. The chunks' texts (`ChunkText`) go to the tiers that take
  them (`takes_texts()`: whether any does, so a store computes them only then): a cache server's
  publishes them in its KV events.
- `stored_locally(keys)`: which keys a local tier holds (or is writing): a store skips them.
- `locate(keys, search_range)`: the tier holding each key (None: none does): one batched
  existence check per tier, for the keys the tiers before it did not have; keys being loaded into
  the hot tier count. `contains_prefix(keys, search_range)`: how many leading keys are cached, and
  in which tier each one is (a `PrefixLookup`).
- `get_prefix(keys)`: the objects of the longest cached prefix: hot hits, then loads already in
  flight are joined, then one batched get per lower tier for the keys still missing; lower-tier
  hits in the prefix are promoted to the hot tier (from tiers that `promote_hits`). Only the
  prefix counts as served: what a tier had past the first gap is released.
- `prefetch(lookup)`: start loading the non-hot chunks of a lookup's prefix into the hot tier
  (from tiers that `promote_hits`),
  one batched get per tier from the tier the lookup found each chunk in (no second existence
  check). A `get_prefix` of a key being loaded waits for that load instead of reading it again.
- `acquire_lease(lease_id, keys, ttl)` / `release_lease(lease_id)`: pin keys in every tier (see
  `leases`) until they are loaded or the lease ends.

Tiers never call the manager. What they store and drop they report as events (`events`); the
manager takes every tier's events when a call that may have changed the tiers returns (allocate,
put, locate, get, prefetch, clear; events of a tier's own threads wait for the next such call)
and does the follow-up there: the keys the local tiers stored or dropped are announced to the
tiers that `publishes_local_keys` (the peer tier) as held or gone, by what the local tiers hold
at that moment (a chunk evicted from memory may still be on disk). After `publish_events()`,
the events of the tiers with a `medium` are also kept, in a bounded buffer (`published`, the oldest
dropped and counted), for whoever publishes them to subscribers (vLLM's KV events: the connector,
the cache server's publisher); `take_published` drains the tiers first.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.chunk_hash import ChunkText
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.failures import FailureDomains
from lmcache.memory_management import MemoryAllocatorInterface, MemoryFormat, MemoryObj, release_all
from lmcache.memory_management.tensor_allocator import allocate_leading
from lmcache.observability import Counters, TierStats, add_counts, log_once
from lmcache.storage_backend.abstract_backend import StorageBackendInterface, TierContext
from lmcache.storage_backend.events import MAX_EVENTS, EventBuffer, PublishedEvent
from lmcache.storage_backend.evictor import EvictionDomain
from lmcache.storage_backend.leases import LeaseTable, PinTable
from lmcache.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.storage_backend.registry import create_tiers, tier_names

logger = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")
LOAD_WORKERS = 4


@dataclass
class PrefixLookup:
    """The answer of `contains_prefix`: `keys` asked about; `tiers[i]` holds `keys[i]` for each
    key of the cached prefix (so `hits == len(tiers)`)."""

    keys: list[CacheEngineKey]
    tiers: list[StorageBackendInterface] = field(default_factory=list)

    @property
    def hits(self) -> int:
        return len(self.tiers)


class _Load:
    """A load of one key into the hot tier; `join` waits for it and hands out a reference."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.obj: MemoryObj | None = None
        self.waiters = 0

    def join(self) -> MemoryObj | None:
        self.done.wait()
        return self.obj  # `finish` took a reference for every waiter


def _then_drain_events(method: Callable[Concatenate[StorageManager, P], T]
                      ) -> Callable[Concatenate[StorageManager, P], T]:
    """`method`, then the tiers' events are taken and acted on (`StorageManager.drain_events`)."""

    @functools.wraps(method)
    def run(self: StorageManager, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.drain_events()

    return run


class StorageManager:
    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 allocator: MemoryAllocatorInterface, faults: FailureDomains | None = None,
                 eviction: EvictionDomain[Any] | None = None) -> None:
        """`faults` guards the tiers (one domain per tier name; by default backing off from 0.5 s
        up to 30 s); `eviction`: the eviction order the hot tier shares with the hot tiers of other
        managers on the same `allocator` (by default its own)."""
        self.allocator = allocator
        self.pins = PinTable()
        self.leases = LeaseTable(self.pins)
        # empty until the tiers exist: a tier's threads may ask `has_local` while it starts up
        self.tiers: list[StorageBackendInterface] = []
        self.published: EventBuffer[PublishedEvent] | None = None
        self._drain_lock = threading.Lock()
        self.tiers = create_tiers(TierContext(config, metadata, allocator, self._allocate, self.pins,
                                              self.read_local, lambda key: self.stored_locally([key])[0],
                                              eviction))
        self._listeners = [t for t in self.tiers if t.publishes_local_keys]
        hot = [t for t in self.tiers if isinstance(t, LocalCPUBackend)]
        self.hot: LocalCPUBackend | None = hot[0] if hot else None
        self.lower = [t for t in self.tiers if t is not self.hot]
        self._faults = faults or FailureDomains(lambda name: f"storage tier {name}")
        self._counts = {t.name: Counters() for t in self.tiers}
        self._lock = threading.Lock()
        self._loading: dict[CacheEngineKey, _Load] = {}
        self._loads = ThreadPoolExecutor(LOAD_WORKERS, thread_name_prefix="lmcache-prefetch")
        self._closed = False

    def publish_events(self, max_events: int = MAX_EVENTS) -> None:
        """From now on keep the events of the tiers with a `medium` for `take_published`."""
        self.published = EventBuffer("published tier", max_events)

    def take_published(self) -> list[PublishedEvent]:
        """The events kept since the last call, oldest first (none unless `publish_events`)."""
        self.drain_events()
        return self.published.take() if self.published is not None else []

    @property
    def backends(self) -> dict[str, StorageBackendInterface]:
        """The tiers by name, in lookup order."""
        return {t.name: t for t in self.tiers}

    @staticmethod
    def resolve_search_range(search_range: str | Iterable[str] | None) -> set[str] | None:
        """The tier names (`name`, not alias) that `search_range` selects; None = every tier.
        A string is one name. Raises ValueError for unknown names."""
        if search_range is None:
            return None
        names = [search_range] if isinstance(search_range, str) else list(search_range)
        known = tier_names()
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown storage backend name(s) {unknown} in search_range; "
                             f"valid names are {list(known)}")
        return {known[n] for n in names}

    # ---- store ------------------------------------------------------------------------------------

    @_then_drain_events
    def allocate(self, shape: torch.Size, dtype: torch.dtype | None,
                 fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> MemoryObj | None:
        return self._allocate(shape, dtype, fmt)

    def _allocate(self, shape: torch.Size, dtype: torch.dtype | None,
                  fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> MemoryObj | None:
        """`allocate` for the tiers (their reads' buffers): their events wait for the manager's call."""
        if self.hot is not None:
            return self.hot.allocate(shape, dtype, fmt)
        return self.allocator.allocate(shape, dtype, fmt)

    @_then_drain_events
    def allocate_many(self, shapes: Sequence[torch.Size], dtype: torch.dtype | None,
                      fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> list[MemoryObj]:
        """Buffers for the leading `shapes` that fit (evicting as `allocate` does), in order."""
        if self.hot is None:
            return self.allocator.allocate_many(shapes, dtype, fmt)
        return allocate_leading(self.hot.allocate, shapes, dtype, fmt)

    def takes_texts(self) -> bool:
        """Whether a tier wants the chunks' texts with `put_many` (else they need not be computed)."""
        return any(tier.takes_texts for tier in self.tiers)

    def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        self.put_many([key], [memory_obj])

    @_then_drain_events
    def put_many(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj],
                 texts: Sequence[ChunkText | None] | None = None) -> None:
        """`put` of each pair, one call per tier; `texts`, each chunk's text (where known), for the
        tiers that `takes_texts`."""
        for tier in self.tiers:
            self._guard(tier, tier.batched_put, None, keys, objs, texts if tier.takes_texts else None)

    def _promote(self, keys: list[CacheEngineKey], objs: Sequence[MemoryObj | None]) -> None:
        """Lower-tier hits enter the hot tier."""
        if self.hot is None:
            return
        for key, obj in zip(keys, objs, strict=True):
            if obj is not None:
                self.hot.submit_put_task(key, obj)

    def drain_events(self) -> None:
        """Take every tier's events and act on them (see the module doc); the decorated calls do
        this as they return."""
        touched: dict[CacheEngineKey, None] = {}
        published = self.published
        with self._drain_lock:  # events taken by two threads reach `published` in order
            for tier in self.tiers:
                for event in tier.take_events():
                    if tier.is_local:
                        touched.update(dict.fromkeys(event.keys))
                    if published is not None and tier.medium is not None:
                        published.append(PublishedEvent(tier.medium, event))
        if not self._listeners or not touched:
            return
        keys = list(touched)
        held = self.stored_locally(keys)
        added = [k for k, h in zip(keys, held, strict=True) if h]
        removed = [k for k, h in zip(keys, held, strict=True) if not h]
        for tier in self._listeners:
            self._guard(tier, tier.local_keys_changed, None, added, removed)

    def read_local(self, key: CacheEngineKey) -> MemoryObj | None:
        """`key`'s chunk from the first local tier that has it (one reference for the caller)."""
        for tier in self.tiers:
            if tier.is_local:
                obj = self._guard(tier, tier.get_blocking, None, key)
                if obj is not None:
                    return obj
        return None

    def stored_locally(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Whether a local tier holds (or is writing) each key."""
        out = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, hit in enumerate(out) if not hit]
            if not todo or not tier.is_local:
                continue
            hits = self._guard(tier, tier.batched_contains, None, [keys[i] for i in todo])
            for i, hit in zip(todo, hits or (), strict=False):
                out[i] = hit
        return out

    # ---- lookup -----------------------------------------------------------------------------------

    def contains_prefix(self, keys: Sequence[CacheEngineKey],
                        search_range: str | Iterable[str] | None = None) -> PrefixLookup:
        lookup = PrefixLookup(list(keys))
        for holder in self.locate(keys, search_range):
            if holder is None:
                break
            lookup.tiers.append(holder)
        return lookup

    @_then_drain_events
    def locate(self, keys: Sequence[CacheEngineKey], search_range: str | Iterable[str] | None = None
               ) -> list[StorageBackendInterface | None]:
        wanted = self.resolve_search_range(search_range)
        found: list[StorageBackendInterface | None] = [None] * len(keys)
        if self.hot is not None and (wanted is None or self.hot.name in wanted):
            with self._lock:  # a key being loaded into the hot tier is as good as hot
                loading = set(self._loading)
            for i, key in enumerate(keys):
                if self.hot.contains(key) or key in loading:
                    found[i] = self.hot
        for tier in self.lower:
            todo = [i for i, t in enumerate(found) if t is None]
            if not todo:
                break
            if wanted is not None and tier.name not in wanted:
                continue
            hits = self._guard(tier, tier.batched_contains, None, [keys[i] for i in todo])
            for i, hit in zip(todo, hits or (), strict=False):
                if hit:
                    found[i] = tier
        return found

    # ---- retrieve ---------------------------------------------------------------------------------

    @_then_drain_events
    def get_prefix(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj]:
        """Objects (one reference each, owned by the caller) for the longest cached prefix of
        `keys`. Only that prefix counts as served and is promoted: what a tier had past the
        first gap is released."""
        n = len(keys)
        objs: list[MemoryObj | None] = [None] * n
        source: list[StorageBackendInterface | None] = [None] * n  # None: a joined load's
        joined: dict[int, _Load] = {}
        try:
            if self.hot is not None:
                for i, key in enumerate(keys):
                    objs[i] = self.hot.get_blocking(key)
                    source[i] = self.hot
            with self._lock:
                for i, key in enumerate(keys):
                    load = self._loading.get(key) if objs[i] is None else None
                    if load is not None:
                        load.waiters += 1
                        joined[i] = load
            self._read_lower(keys, objs, source, [i for i in range(n) if objs[i] is None and i not in joined])
            for i, load in joined.items():
                objs[i], source[i] = load.join(), None
            self._read_lower(keys, objs, source, [i for i in joined if objs[i] is None])  # a failed load
        except BaseException:
            release_all(objs + self._leave([load for i, load in joined.items() if objs[i] is None]))
            raise
        cut = next((i for i, obj in enumerate(objs) if obj is None), n)
        for tier in self.tiers:
            mine = [i for i in range(cut) if source[i] is tier]
            if mine:
                self._served(tier, [objs[i] for i in mine])
                if tier is not self.hot and tier.promote_hits:
                    self._promote([keys[i] for i in mine], [objs[i] for i in mine])
        release_all(objs[cut:])
        return [obj for obj in objs[:cut] if obj is not None]

    def _leave(self, loads: list[_Load]) -> list[MemoryObj | None]:
        """Stop waiting for `loads` (joined, not yet joined): one still in flight takes no
        reference for this waiter; what one that has finished took is returned, to release."""
        taken: list[MemoryObj | None] = []
        with self._lock:
            for load in loads:
                if load.done.is_set():
                    taken.append(load.obj)
                else:
                    load.waiters -= 1
        return taken

    def _read_lower(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj | None],
                    source: list[StorageBackendInterface | None], todo: list[int]) -> None:
        """Fill `objs[i]` for `i` in `todo` from the lower tiers, one batched get per tier, and
        `source[i]` with the tier that had it."""
        for tier in self.lower:
            if not todo:
                return
            got = self._batched_get(tier, [keys[i] for i in todo])
            for i, obj in zip(todo, got, strict=True):
                objs[i], source[i] = obj, tier
            todo = [i for i in todo if objs[i] is None]

    # ---- prefetch ---------------------------------------------------------------------------------

    def prefetch(self, lookup: PrefixLookup) -> int:
        """Start loading the prefix chunks of `lookup` that are not hot into the hot tier, one
        batched get per tier; returns how many loads started (none without a hot tier)."""
        if self.hot is None:
            return 0
        batches: dict[int, tuple[StorageBackendInterface, list[CacheEngineKey], list[_Load]]] = {}
        with self._lock:
            if self._closed:
                return 0
            for key, tier in zip(lookup.keys, lookup.tiers):
                if tier is self.hot or not tier.promote_hits or key in self._loading \
                        or self.hot.contains(key):
                    continue
                load = self._loading[key] = _Load()
                batch = batches.setdefault(id(tier), (tier, [], []))
                batch[1].append(key)
                batch[2].append(load)
            for tier, keys, loads in batches.values():  # under the lock: `close` cannot come between
                self._loads.submit(self._load_batch, tier, keys, loads)
        return sum(len(b[1]) for b in batches.values())

    @_then_drain_events
    def _load_batch(self, tier: StorageBackendInterface, keys: list[CacheEngineKey],
                    loads: list[_Load]) -> None:
        got: list[MemoryObj | None] = [None] * len(keys)
        try:
            got = self._batched_get(tier, keys)
            self._served(tier, got)
            self._promote(keys, got)
        finally:
            with self._lock:
                for key, load, obj in zip(keys, loads, got, strict=True):
                    del self._loading[key]
                    if obj is not None:
                        for _ in range(load.waiters):
                            obj.ref_count_up()
                    load.obj = obj
                    load.done.set()
            release_all(got)

    # ---- leases -----------------------------------------------------------------------------------

    def acquire_lease(self, lease_id: str, keys: list[CacheEngineKey], ttl: float) -> None:
        self.leases.acquire(lease_id, keys, ttl)
        for tier in self.tiers:
            self._guard(tier, tier.lease, None, lease_id, keys, ttl)

    def release_lease(self, lease_id: str) -> None:
        self.leases.release(lease_id)
        for tier in self.tiers:
            self._guard(tier, tier.end_lease, None, lease_id)

    # ---- operations -----------------------------------------------------------------------------

    CLEARABLE = ("hot", "disk", "all")

    @_then_drain_events
    def clear(self, which: str) -> dict[str, int]:
        """Empty local tiers: "hot" (CPU memory), "disk" (the other local tiers) or "all" (every
        local tier); shared and peer tiers are never cleared from here. Chunks per tier."""
        if which not in self.CLEARABLE:
            raise ValueError(f"cannot clear {which!r}: choose one of {list(self.CLEARABLE)}")
        chosen = [t for t in self.tiers
                  if t.is_local and (which == "all" or (t is self.hot) == (which == "hot"))]
        return {t.name: t.clear() for t in chosen}

    def check_integrity(self, at_rest: bool = False) -> None:
        """Raise AssertionError unless the arena's books balance, every tier's do (the hot tier
        holds only live objects, `at_rest`: held by nobody else) and no load is in flight."""
        self.allocator.check_integrity()
        for tier in self.tiers:
            tier.check_integrity(at_rest)
        with self._lock:
            if self._loading:
                raise AssertionError(f"{len(self._loading)} loads still in flight")

    def health(self) -> dict[str, bool]:
        """Whether each tier works (False while its store fails)."""
        return {t.name: bool(self._guard(t, t.healthy, False)) for t in self.tiers}

    def stats(self) -> dict[str, TierStats]:
        """Each tier's counters and gauges, added to what this manager counts for it: ``hits``
        (chunks served), ``bytes_read``, and the ``failures`` / ``skipped`` of its guard (a tier
        that guards its own nodes or peers reports theirs; both are summed, never replaced)."""
        out = {}
        for tier in self.tiers:
            own = tier.stats()  # the tier's own counters: never the store, so never backed off from
            ours = add_counts(self._counts[tier.name].snapshot(), self._faults.counts(tier.name))
            out[tier.name] = TierStats(add_counts(own.counters, ours), own.gauges)
        return out

    def _served(self, tier: StorageBackendInterface, objs: Sequence[MemoryObj | None]) -> None:
        found = [o for o in objs if o is not None]
        if found:
            counts = self._counts[tier.name]
            counts.add("hits", len(found))
            counts.add("bytes_read", sum(o.get_size() for o in found))

    # ---- internals --------------------------------------------------------------------------------

    def _batched_get(self, tier: StorageBackendInterface,
                     keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """`tier`'s objects for `keys`, one per key (a fault is all misses; an answer of another
        length, a bug in the tier, is all misses too: its objects are released)."""
        got = self._guard(tier, tier.batched_get, None, keys)
        if got is None or len(got) == len(keys):
            return got if got is not None else [None] * len(keys)
        release_all(got)
        log_once(logger, ("batched_get", tier.name), "storage tier %s answered %d objects for %d keys: "
                 "treated as misses (logged once)", tier.name, len(got), len(keys))
        return [None] * len(keys)

    def _guard(self, tier: StorageBackendInterface, fn: Callable[..., T], default: Any, *args: Any) -> T:
        """Call into a tier; for one that `may_fail`, through its failure domain (a fault is
        `default`: a miss)."""
        if not tier.may_fail:
            return fn(*args)
        return self._faults.call(tier.name, lambda: fn(*args), default)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._loads.shutdown(wait=True)
        self.leases.close()
        for tier in reversed(self.tiers):
            try:
                tier.close()
            except Exception:
                logger.exception("closing storage tier %s failed", tier.name)
