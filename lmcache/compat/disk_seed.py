"""Seed 000's `LocalDiskBackend`: the core disk tier plus the seed's per-key calls that the core's
batched path does not use.

- `insert_key(key, size)`: record that `key`'s file (of `size` bytes) is on disk.
- `async_load_bytes_from_disk(key)`: `load_bytes_from_disk(key)` on the tier's load pool: a Future
  of the object (one reference for the caller; None on a miss, and once the tier is closed).
- `submit_prefetch_task(key)`: `get_blocking(key)` on the load pool (a key still being written is
  served from memory): a Future of the object (None on a miss); None instead of a Future once the
  tier is closed.

The seed path `lmcache.experimental.storage_backend.local_disk_backend.LocalDiskBackend` is this
class. The engine's storage manager builds the core class (`lmcache.storage_backend.
local_disk_backend.LocalDiskBackend`, the one registered as a tier): it reads in batches and
prefetches through `StorageManager.prefetch`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from lmcache.cache_key import CacheEngineKey
from lmcache.memory_management import MemoryObj
from lmcache.storage_backend import local_disk_backend


class LocalDiskBackend(local_disk_backend.LocalDiskBackend):
    def insert_key(self, key: CacheEngineKey, size: int) -> None:
        if size < 0:
            raise ValueError(f"size={size}: a file's size is >= 0")
        self._insert_stem(self._seen(key), size)

    def async_load_bytes_from_disk(self, key: CacheEngineKey) -> Future[MemoryObj | None]:
        future = self._submit_load(self.load_bytes_from_disk, key)
        if future is None:  # closed: a miss
            future = Future()
            future.set_result(None)
        return future

    def submit_prefetch_task(self, key: CacheEngineKey) -> Future[MemoryObj | None] | None:
        return self._submit_load(self.get_blocking, key)

    def _submit_load(self, load: Callable[[CacheEngineKey], MemoryObj | None],
                     key: CacheEngineKey) -> Future[MemoryObj | None] | None:
        """`load(key)` on the load pool; None once the tier is closed (its pool is shut down)."""
        with self._lock:
            if self._closed:
                return None
            return self._loads.submit(load, key)
