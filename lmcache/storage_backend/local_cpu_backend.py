"""`LocalCPUBackend`, the hot tier ("Hot"): memory objects kept in the engine's CPU arena.

It owns eviction for that arena: `allocate` evicts in policy order (LRU by default) until the
allocation fits, skipping objects somebody else still holds (ref count > 1) or that are pinned by a
lookup lease, and returns None when nothing more can be freed. Puts are synchronous.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from lmcache.memory_management import MemoryAllocatorInterface, MemoryFormat, MemoryObj
from lmcache.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.storage_backend.evictor import CachePolicy, make_policy
from lmcache.utils import CacheEngineKey


class LocalCPUBackend(StorageBackendInterface):
    name = "Hot"
    aliases = ("LocalCPUBackend",)  # upstream's later name for it

    def __init__(self, allocator: MemoryAllocatorInterface, policy: str = "LRU") -> None:
        self.allocator = allocator
        self.policy: CachePolicy[CacheEngineKey] = make_policy(policy)
        self.lock = threading.RLock()
        self._objs: dict[CacheEngineKey, MemoryObj] = {}
        self._pins: dict[CacheEngineKey, int] = {}
        self.num_evicted = 0

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
            self.policy.on_insert(key)
        return None

    def submit_prefetch_task(self, key: CacheEngineKey) -> Future | None:
        return None

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        with self.lock:
            obj = self._objs.get(key)
            if obj is None:
                return None
            obj.ref_count_up()
            self.policy.on_access(key)
            return obj

    def remove(self, key: CacheEngineKey) -> bool:
        with self.lock:
            obj = self._objs.pop(key, None)
            if obj is None:
                return False
            self._pins.pop(key, None)
            self.policy.on_remove(key)
        obj.ref_count_down()
        return True

    def pin(self, key: CacheEngineKey) -> bool:
        """Protect `key` from eviction until `unpin`; False if it is not here."""
        with self.lock:
            if key not in self._objs:
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def unpin(self, key: CacheEngineKey) -> None:
        with self.lock:
            n = self._pins.get(key, 0)
            if n <= 1:
                self._pins.pop(key, None)
            else:
                self._pins[key] = n - 1

    def allocate(self, shape: torch.Size, dtype: torch.dtype | None,
                 fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> MemoryObj | None:
        obj = self.allocator.allocate(shape, dtype, fmt)
        if obj is not None:
            return obj
        with self.lock:
            for key in self.policy.candidates():
                victim = self._objs[key]
                if key in self._pins or victim.get_ref_count() > 1:
                    continue
                self.remove(key)
                self.num_evicted += 1
                obj = self.allocator.allocate(shape, dtype, fmt)
                if obj is not None:
                    return obj
        return None

    def close(self) -> None:
        with self.lock:
            keys = list(self._objs)
        for key in keys:
            self.remove(key)
