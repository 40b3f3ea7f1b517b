"""`LocalCPUBackend`, the hot tier ("Hot", alias "LocalCPUBackend"): memory objects kept in the
engine's CPU arena.

It owns eviction for that arena: `allocate` evicts in policy order (LRU by default) until the
allocation fits, skipping objects somebody else still holds (ref count > 1) or that a lookup
lease pins (`PinTable`), and returns None when nothing more can be freed (at once, evicting
nothing, for an object larger than the whole arena). Hot tiers that share an arena (the cache
server's models) share an `EvictionDomain`: one order and one lock, so a full arena evicts
whichever tier's chunks come first, not only the asking tier's. Puts are synchronous.
What it stores, evicts, removes and clears it reports as events (`events`, taken by the storage
manager after the call); it never calls up.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.memory_management import MemoryAllocatorInterface, MemoryFormat, MemoryObj
from lmcache.observability import TierStats
from lmcache.storage_backend.abstract_backend import StorageBackendInterface, TierContext
from lmcache.storage_backend.events import RemovalReason, TierEvents
from lmcache.storage_backend.evictor import EvictionDomain
from lmcache.storage_backend.leases import PinTable
from lmcache.storage_backend.registry import register_tier


@register_tier
class LocalCPUBackend(StorageBackendInterface):
    name = "Hot"
    aliases = ("LocalCPUBackend",)  # upstream's later name for it
    lookup_order = 0
    is_local = True
    medium = "CPU"
    may_fail = False

    def __init__(self, allocator: MemoryAllocatorInterface, policy: str = "LRU",
                 pins: PinTable | None = None,
                 domain: EvictionDomain[tuple[LocalCPUBackend, CacheEngineKey]] | None = None) -> None:
        """`domain`: the eviction order shared with other hot tiers on the same arena (its policy
        then rules, not `policy`); by default one of its own."""
        self.allocator = allocator
        self.events: TierEvents = TierEvents(self.name)
        self.domain: EvictionDomain[tuple[LocalCPUBackend, CacheEngineKey]] = (
            domain if domain is not None else EvictionDomain(policy))
        self.pins = pins if pins is not None else PinTable()
        self.lock = self.domain.lock
        self._objs: dict[CacheEngineKey, MemoryObj] = {}
        self._bytes_used = 0
        self.num_evicted = 0

    @classmethod
    def create(cls, ctx: TierContext) -> LocalCPUBackend | None:
        if not ctx.config.local_cpu or ctx.config.cache_server_url is not None:
            return None  # an engine on a cache server: the server's L1 is its hot tier
        return cls(ctx.allocator, ctx.config.cache_policy, ctx.pins, ctx.eviction)

    def __len__(self) -> int:
        return len(self._objs)

    def contains(self, key: CacheEngineKey) -> bool:
        return key in self._objs

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False

    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Future | None:
        with self.lock:
            if key in self._objs:
                return None
            memory_obj.ref_count_up()
            self._objs[key] = memory_obj
            self._bytes_used += memory_obj.metadata.phy_size
            self.domain.policy.on_insert((self, key))
        self.events.stored([key])
        return None

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        with self.lock:
            obj = self._objs.get(key)
            if obj is None:
                return None
            obj.ref_count_up()
            self.domain.policy.on_access((self, key))
            return obj

    def keys(self) -> list[CacheEngineKey]:
        """The keys held, in no particular order."""
        with self.lock:
            return list(self._objs)

    def remove(self, key: CacheEngineKey) -> bool:
        with self.lock:
            removed = self._drop_locked(key)
        if removed:
            self.events.removed([key], RemovalReason.DELETED)
        return removed

    def _drop_locked(self, key: CacheEngineKey) -> bool:
        """Forget `key` and release the tier's reference (the memory goes back to the allocator, a
        lower layer, if nobody else holds it). Lock held; the caller reports it."""
        obj = self._objs.pop(key, None)
        if obj is None:
            return False
        self._bytes_used -= obj.metadata.phy_size
        self.domain.policy.on_remove((self, key))
        obj.ref_count_down()
        return True

    def allocate(self, shape: torch.Size, dtype: torch.dtype | None,
                 fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> MemoryObj | None:
        obj = self.allocator.allocate(shape, dtype, fmt)
        if obj is not None or not self.allocator.fits(shape, dtype, fmt):
            return obj  # (None: larger than the arena, which no eviction changes)
        evicted: dict[LocalCPUBackend, list[CacheEngineKey]] = {}
        try:
            with self.lock:
                for tier, key in self.domain.policy.candidates():
                    victim = tier._objs[key]
                    if tier.pins.is_pinned(key) or victim.get_ref_count() > 1:
                        continue
                    tier._drop_locked(key)
                    evicted.setdefault(tier, []).append(key)
                    tier.num_evicted += 1
                    obj = self.allocator.allocate(shape, dtype, fmt)
                    if obj is not None:
                        return obj
            return None
        finally:
            for tier, keys in evicted.items():
                tier.events.removed(keys, RemovalReason.EVICTED)

    def check_integrity(self, at_rest: bool = False) -> None:
        """Raise AssertionError unless every object held is live (`at_rest`: and held by this tier
        alone, ref count 1) and the byte count matches them."""
        with self.lock:
            for key, obj in self._objs.items():
                if not obj.valid or obj.get_ref_count() < 1:
                    raise AssertionError(f"hot tier holds a released object for {key}")
                if at_rest and obj.get_ref_count() != 1:
                    raise AssertionError(f"{key} has {obj.get_ref_count()} references at rest")
            held = sum(o.metadata.phy_size for o in self._objs.values())
            if held != self._bytes_used:
                raise AssertionError(f"hot tier counts {self._bytes_used} bytes, holds {held}")

    def stats(self) -> TierStats:
        with self.lock:
            return TierStats({"evicted": self.num_evicted},
                             {"chunks": len(self._objs), "bytes_used": self._bytes_used})

    def clear(self) -> int:
        """Drop every object (pinned ones too); returns how many there were."""
        with self.lock:
            keys = list(self._objs)
            for key in keys:
                self._drop_locked(key)
        self.events.cleared(keys)
        return len(keys)

    def close(self) -> None:
        self.clear()
