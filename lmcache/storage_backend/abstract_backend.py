"""The interface every storage tier implements, and what a tier class declares about itself.

A tier class states, as class attributes, its `name` (what `search_range` and logs call it), its
`aliases`, `lookup_order` (lower is asked first), `is_local` (on this machine: a store skips chunks
a local tier already holds) and `may_fail` (a fault is a cache miss; the storage manager guards
every call). `create(ctx)` builds it from the engine's config, or returns None when the config
does not ask for it. Classes are registered with `registry.register_tier`.

Primitives and when they are called (by the `StorageManager`):
- `contains(key)` / `batched_contains(keys)`: lookups and store-time dedupe; a key whose write is
  still in flight counts as contained. Must be cheap; a batched call is one round trip at most.
- `exists_in_put_tasks(key)`: whether a write of `key` is still in flight.
- `submit_put_task(key, obj)`: store; the backend takes its own reference on `obj` for as long as
  it needs it (the hot tier keeps it; a lower tier drops it once written). Returns a Future for
  asynchronous tiers, None when the put completed (or was dropped) synchronously.
- `batched_put(keys, objs, texts)`: `submit_put_task` of each pair (a tier may do it in one go);
  `texts`, the chunks' texts (`ChunkText`), are given to a tier that `takes_texts` (the cache
  server's, while its server publishes KV events), None otherwise.
- `get_blocking(key)` / `batched_get(keys)`: objects with one reference each owned by the caller
  (None for misses); a key still being written is served from memory. A batched get of a remote
  tier is one round trip per failure domain; of the disk tier, concurrent reads.
- `remove(key)`: drop `key`; True if it was there.
- `clear()`: drop everything this tier holds (local tiers; an operator's request); the count.
- `take_events()`: what the tier stored, removed (evicted, deleted, corrupt, handed over) or
  cleared since the last call (`events.TierEvent`s, oldest first); the manager takes them after
  every call into the tiers. A tier reports through its own `events` buffer and never calls up.
  Default: none.
- `healthy()`: False while the tier is failing (e.g. its store is unreachable).
- `stats()`: the tier's counters and gauges (`TierStats`, for operators and metrics).
- `promote_hits`: whether what a read returns enters the hot tier (the manager's promotion and
  prefetch); False for a tier whose objects are handed over, not shared (default True).
- `local_keys_changed(added, removed)`: the local tiers now hold `added` and no longer hold
  `removed`; called only on tiers with `publishes_local_keys` (e.g. the peer tier, which tells
  other instances), by the manager as it takes the local tiers' events. Default: nothing.
- `lease(lease_id, keys, ttl)` / `end_lease(lease_id)`: a lookup lease on `keys` starts / ends
  (the manager's own `PinTable` protects chunks held in this process; a tier whose chunks live in
  another process, the cache server, pins them there). Default: nothing.
- `check_integrity(at_rest)`: raise AssertionError unless the tier's books balance (`at_rest`:
  and nothing is in flight); for tests and operators. Default: nothing to check.
- `close()`: finish or cancel pending work (bounded wait) and release resources.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lmcache.cache_key import CacheEngineKey
from lmcache.chunk_hash import ChunkText
from lmcache.memory_management import MemoryObj
from lmcache.observability import TierStats
from lmcache.storage_backend.events import TierEvent, TierEvents

if TYPE_CHECKING:
    from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
    from lmcache.memory_management import MemoryAllocatorInterface
    from lmcache.storage_backend.evictor import EvictionDomain
    from lmcache.storage_backend.leases import PinTable
    from lmcache.storage_backend.serde.serde import AllocateFn


def _no_read(key: CacheEngineKey) -> MemoryObj | None:
    return None


@dataclass(frozen=True)
class TierContext:
    """What a tier is built from. `allocate(shape, dtype, fmt)` hands out arena buffers, evicting
    from the hot tier; `pins` says which keys a lookup lease protects from eviction;
    `read_local(key)` reads a chunk from the local tiers (one reference for the caller; None if
    none holds it) and `has_local(key)` says whether one holds it (the peer server's and the PD
    receiver's questions). `eviction`: the eviction order the hot tier shares with others on the
    same arena. Nothing here reports to the manager: tiers report through `events`."""

    config: LMCacheEngineConfig
    metadata: LMCacheEngineMetadata
    allocator: MemoryAllocatorInterface
    allocate: AllocateFn
    pins: PinTable
    read_local: Callable[[CacheEngineKey], MemoryObj | None] = _no_read
    has_local: Callable[[CacheEngineKey], bool] = lambda key: False
    eviction: EvictionDomain[Any] | None = None


class StorageBackendInterface(abc.ABC):
    name: ClassVar[str] = "StorageBackend"
    aliases: ClassVar[tuple[str, ...]] = ()
    lookup_order: ClassVar[int] = 100
    is_local: ClassVar[bool] = True
    may_fail: ClassVar[bool] = True
    # True for tiers that publish what this instance holds: the manager then calls
    # `local_keys_changed` whenever the local tiers gain or lose keys
    publishes_local_keys: ClassVar[bool] = False
    promote_hits: bool = True
    takes_texts: bool = False  # whether `batched_put` wants the chunks' texts (computed for it)
    lossy: bool = False  # whether its chunks only approximate the KV stored (a CacheGen-coded tier)
    events: TierEvents | None = None  # set by a tier that reports what it stores and drops
    # the kind of memory the tier keeps chunks in, as vLLM's KV events name it ("CPU", "STORAGE");
    # None: its events are not published to subscribers (`StorageManager.publish_events`)
    medium: ClassVar[str | None] = None

    @classmethod
    def create(cls, ctx: TierContext) -> StorageBackendInterface | None:
        """This tier for `ctx.config`, or None when the config does not enable it."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a config")

    @abc.abstractmethod
    def contains(self, key: CacheEngineKey) -> bool: ...

    @abc.abstractmethod
    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool: ...

    @abc.abstractmethod
    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Future | None: ...

    @abc.abstractmethod
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None: ...

    @abc.abstractmethod
    def remove(self, key: CacheEngineKey) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        return [self.contains(k) or self.exists_in_put_tasks(k) for k in keys]

    def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        return [self.get_blocking(k) for k in keys]

    def batched_put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj],
                    texts: Sequence[ChunkText | None] | None = None) -> None:
        """`submit_put_task` of each pair (`texts`: see the module doc)."""
        for key, obj in zip(keys, objs, strict=True):
            self.submit_put_task(key, obj)

    def clear(self) -> int:
        raise NotImplementedError(f"the {self.name} tier cannot be cleared from here")

    def take_events(self) -> list[TierEvent]:
        return self.events.take() if self.events is not None else []

    def healthy(self) -> bool:
        return True

    def stats(self) -> TierStats:
        return TierStats()

    def check_integrity(self, at_rest: bool = False) -> None:  # noqa: B027 - optional hook
        pass

    def lease(self, lease_id: str, keys: Sequence[CacheEngineKey],  # noqa: B027 - optional hook
              ttl: float) -> None:
        pass

    def end_lease(self, lease_id: str) -> None:  # noqa: B027 - optional hook
        pass

    def local_keys_changed(self, added: Sequence[CacheEngineKey],  # noqa: B027 - optional hook
                           removed: Sequence[CacheEngineKey]) -> None:
        pass
