"""The interface every storage tier implements.

Primitives and when they are called (by the `StorageManager`):
- `contains(key)`: lookups and store-time dedupe; must be cheap and never raise for a tier fault.
- `exists_in_put_tasks(key)`: whether a write of `key` is still in flight.
- `submit_put_task(key, obj)`: store; the backend takes its own reference on `obj` for as long as
  it needs it (the hot tier keeps it; a lower tier drops it once written). Returns a Future for
  asynchronous tiers, None when the put completed (or was dropped) synchronously.
- `submit_prefetch_task(key)`: start loading `key` so a later `get_blocking` is fast; returns a
  Future resolving to the loaded object (or None), or None if there is nothing to prefetch.
- `get_blocking(key)`: the object with one reference owned by the caller, or None on a miss.
- `remove(key)`: drop `key`; True if it was there.
- `close()`: finish or cancel pending work (bounded wait) and release resources.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future

from lmcache.memory_management import MemoryObj
from lmcache.utils import CacheEngineKey


class StorageBackendInterface(abc.ABC):
    name: str = "StorageBackend"
    aliases: tuple[str, ...] = ()  # other names `search_range` accepts for this tier

    @abc.abstractmethod
    def contains(self, key: CacheEngineKey) -> bool: ...

    @abc.abstractmethod
    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool: ...

    @abc.abstractmethod
    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Future | None: ...

    @abc.abstractmethod
    def submit_prefetch_task(self, key: CacheEngineKey) -> Future | None: ...

    @abc.abstractmethod
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None: ...

    @abc.abstractmethod
    def remove(self, key: CacheEngineKey) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None: ...
