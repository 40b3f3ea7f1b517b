"""`LowerTierBackend`: what the disk and remote tiers share.

A subclass supplies `_write(key, obj)` (store one object; runs on a put worker), `_read(key)` (a
new object from `self.allocate` with one reference for the caller, or None), `contains` and
`remove`, and optionally `_should_put(key)` (skip keys it already holds) and `_close()`.
This class provides the rest of the backend interface:
- puts go through an `AsyncPutQueue` (bounded, deduplicated, holds a reference until written);
- `get_blocking` serves a key still being written from memory, otherwise `_read`s it;
- `submit_prefetch_task` runs `get_blocking` on a small load pool (the storage manager promotes
  the result into the hot tier); a key already being prefetched gets a Future resolving to None;
- `close` flushes the queued writes (bounded wait), then stops the pools.
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from lmcache.memory_management import MemoryObj
from lmcache.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.storage_backend.async_put import AsyncPutQueue
from lmcache.storage_backend.serde.serde import AllocateFn
from lmcache.utils import CacheEngineKey


@dataclass(frozen=True)
class TierPools:
    """Sizes of a lower tier's pools. `max_pending_puts` bounds the writes in flight (each holds
    a hot-tier buffer); `close_timeout` bounds how long `close` waits for them."""

    put_workers: int = 2
    max_pending_puts: int = 64
    load_workers: int = 2
    close_timeout: float = 10.0


class LowerTierBackend(StorageBackendInterface):
    def __init__(self, allocate: AllocateFn, pools: TierPools | None = None) -> None:
        pools = pools or TierPools()
        self.allocate = allocate
        self.close_timeout = pools.close_timeout
        self.puts = AsyncPutQueue(self.name, self._write, num_workers=pools.put_workers,
                                  max_pending=pools.max_pending_puts)
        self._loads = ThreadPoolExecutor(pools.load_workers, thread_name_prefix=f"lmcache-{self.name}-load")
        self._lock = threading.Lock()
        self._prefetching: set[CacheEngineKey] = set()
        self._closed = False

    @abc.abstractmethod
    def _write(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Store `obj` under `key` (runs on a put worker; may raise, which counts as a failed put)."""

    @abc.abstractmethod
    def _read(self, key: CacheEngineKey) -> MemoryObj | None:
        """`key`'s object in a buffer from `self.allocate` (reference owned by the caller), or None."""

    def _should_put(self, key: CacheEngineKey) -> bool:
        return True

    def _close(self) -> None:
        pass

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self.puts.contains(key)

    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Future | None:
        if not self._should_put(key):
            return None
        return self.puts.submit(key, memory_obj)

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        obj = self.puts.get_pending(key)
        return obj if obj is not None else self._read(key)

    def submit_prefetch_task(self, key: CacheEngineKey) -> Future | None:
        with self._lock:
            if self._closed:
                return None
            if key in self._prefetching:
                already: Future = Future()
                already.set_result(None)
                return already
            self._prefetching.add(key)
        future = self._loads.submit(self.get_blocking, key)
        future.add_done_callback(lambda _f: self._prefetch_done(key))
        return future

    def _prefetch_done(self, key: CacheEngineKey) -> None:
        with self._lock:
            self._prefetching.discard(key)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.puts.close(self.close_timeout)
        self._loads.shutdown(wait=True, cancel_futures=True)
        self._close()
