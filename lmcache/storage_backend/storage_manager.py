"""`StorageManager`: one face over the tiers, in order hot -> local disk -> remote.

- `allocate`: a buffer for a new chunk from the engine's CPU arena, evicting from the hot tier.
- `put`: the hot tier keeps the object synchronously; lower tiers get it asynchronously.
- `get`: the first tier that has the key answers; a lower-tier hit is promoted to the hot tier.
- `contains` / `prefetch`: existence checks and early loads, optionally limited to some tiers.
A lower tier that raises is a miss (logged once per incident), never an error for the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import MemoryAllocatorInterface, MemoryFormat, MemoryObj
from lmcache.observability import IncidentLog
from lmcache.storage_backend import TIER_CLASSES, create_storage_backends
from lmcache.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.utils import CacheEngineKey

logger = logging.getLogger(__name__)

# every name a tier answers to (its `name` and `aliases`) -> its `name`
TIER_NAMES = {n: cls.name for cls in TIER_CLASSES for n in (cls.name, *cls.aliases)}


class StorageManager:
    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 allocator: MemoryAllocatorInterface) -> None:
        self.allocator = allocator
        self.backends: dict[str, StorageBackendInterface] = create_storage_backends(
            config, metadata, allocator, self.allocate)
        hot = self.backends.get("Hot")
        self.hot: LocalCPUBackend | None = hot if isinstance(hot, LocalCPUBackend) else None
        self._incidents = {name: IncidentLog(logger, f"storage tier {name}") for name in self.backends}

    @staticmethod
    def resolve_search_range(search_range: str | Iterable[str] | None) -> set[str] | None:
        """The tier names (`name`, not alias) that `search_range` selects; None = every tier.
        A string is one name. Raises ValueError for unknown names."""
        if search_range is None:
            return None
        names = [search_range] if isinstance(search_range, str) else list(search_range)
        unknown = [n for n in names if n not in TIER_NAMES]
        if unknown:
            raise ValueError(f"unknown storage backend name(s) {unknown} in search_range; "
                             f"valid names are {list(TIER_NAMES)}")
        return {TIER_NAMES[n] for n in names}

    def _selected(self, search_range: str | Iterable[str] | None,
                  ) -> list[tuple[str, StorageBackendInterface]]:
        wanted = self.resolve_search_range(search_range)
        return [(n, b) for n, b in self.backends.items() if wanted is None or n in wanted]

    def allocate(self, shape: torch.Size, dtype: torch.dtype | None,
                 fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> MemoryObj | None:
        if self.hot is not None:
            return self.hot.allocate(shape, dtype, fmt)
        return self.allocator.allocate(shape, dtype, fmt)

    def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        for name, backend in self.backends.items():
            self._guard(name, backend.submit_put_task, key, memory_obj)

    def get(self, key: CacheEngineKey) -> MemoryObj | None:
        for name, backend in self.backends.items():
            obj = self._guard(name, backend.get_blocking, key)
            if obj is not None:
                if self.hot is not None and backend is not self.hot:
                    self.hot.submit_put_task(key, obj)
                return obj
        return None

    def contains(self, key: CacheEngineKey, search_range: str | Iterable[str] | None = None) -> bool:
        for name, backend in self._selected(search_range):
            if self._guard(name, backend.contains, key) or self._guard(
                    name, backend.exists_in_put_tasks, key):
                return True
        return False

    def prefetch(self, key: CacheEngineKey) -> bool:
        """Start loading `key` from the first lower tier that has it (or is still writing it) into
        the hot tier; True if it is already hot or a load started. Without a hot tier there is
        nowhere to load to: False."""
        if self.hot is None:
            return False
        if self.hot.contains(key):
            return True
        for name, backend in self.backends.items():
            if backend is self.hot or not (self._guard(name, backend.exists_in_put_tasks, key)
                                           or self._guard(name, backend.contains, key)):
                continue
            future = self._guard(name, backend.submit_prefetch_task, key)
            if future is None:
                return False
            future.add_done_callback(lambda f, k=key: self._promote(k, f))
            return True
        return False

    def _promote(self, key: CacheEngineKey, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        obj = future.result()
        if obj is None:
            return
        if self.hot is not None:
            self.hot.submit_put_task(key, obj)
        obj.ref_count_down()

    def remove(self, key: CacheEngineKey) -> bool:
        removed = False
        for name, backend in self.backends.items():
            removed = bool(self._guard(name, backend.remove, key)) or removed
        return removed

    def _guard(self, name: str, fn, *args):  # type: ignore[no-untyped-def]
        """Call a tier; a lower tier's failure becomes a miss (None) logged once per incident."""
        if name == "Hot":
            return fn(*args)
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - any tier fault is a miss
            self._incidents[name].fail(e)
            return None
        self._incidents[name].recover()
        return result

    def close(self) -> None:
        for name, backend in reversed(list(self.backends.items())):
            try:
                backend.close()
            except Exception:
                logger.exception("closing storage tier %s failed", name)
