"""`LowerTierBackend`: what the disk and remote tiers share.

A subclass supplies `_write(key, obj)` (store one object; runs on a put worker), `_read(key)` (a
new object from `self.allocate` with one reference for the caller, or None), `contains` and
`remove`, and optionally `_read_many(keys)` (a batch in one request or concurrently; by default
one `_read` after another), `_contains_many(keys)`, `_should_put(key)` (skip keys it already
holds) and `_close()`. This class provides the rest of the backend interface:
- puts go through an `AsyncPutQueue` (bounded, deduplicated, holds a reference until written);
- `get_blocking` / `batched_get` serve keys still being written from memory, and `_read` /
  `_read_many` the rest; `batched_contains` counts keys being written as contained;
- `close` flushes the queued writes (bounded wait), then stops the put workers and calls `_close`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from lmcache.cache_key import CacheEngineKey
from lmcache.memory_management import MemoryObj, release_all
from lmcache.observability import TierStats, add_counts
from lmcache.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.storage_backend.async_put import AsyncPutQueue
from lmcache.storage_backend.serde.serde import AllocateFn


def gather_all(futures: Sequence[Future]) -> list[MemoryObj | None]:
    """The results of reads running concurrently; if any raised, the others' objects are
    released and the first error is raised."""
    out: list[MemoryObj | None] = []
    error: BaseException | None = None
    for future in futures:
        try:
            out.append(future.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below, after releasing the rest
            error = error or e
            out.append(None)
    if error is not None:
        release_all(out)
        raise error
    return out


@dataclass(frozen=True)
class TierPools:
    """Sizes of a lower tier's pools. `max_pending_puts` bounds the writes in flight (each holds
    a hot-tier buffer); `close_timeout` bounds how long `close` waits for them; `load_workers`
    read a batch concurrently (the disk tier)."""

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
        self._lock = threading.Lock()
        self._closed = False

    @abc.abstractmethod
    def _write(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Store `obj` under `key` (runs on a put worker; may raise, which counts as a failed put,
        or `failures.NoRoom` / `TooLarge` where the store has no room for it: a dropped put)."""

    @abc.abstractmethod
    def _read(self, key: CacheEngineKey) -> MemoryObj | None:
        """`key`'s object in a buffer from `self.allocate` (reference owned by the caller), or None."""

    def _read_many(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        return [self._read(k) for k in keys]

    def _contains_many(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

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

    def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        out = [self.puts.get_pending(k) for k in keys]
        todo = [i for i, obj in enumerate(out) if obj is None]
        if todo:
            try:
                read = self._read_many([keys[i] for i in todo])
            except BaseException:
                release_all(out)
                raise
            for i, obj in zip(todo, read, strict=True):
                out[i] = obj
        return out

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        out = [self.puts.contains(k) for k in keys]
        todo = [i for i, hit in enumerate(out) if not hit]
        if todo:
            for i, hit in zip(todo, self._contains_many([keys[i] for i in todo]), strict=True):
                out[i] = hit
        return out

    def stats(self) -> TierStats:
        """The put queue's numbers (``too_large`` and ``no_room``: puts the store refused for lack
        of room, also in ``puts_dropped``), with the faults its failure domain caught
        (``failures``, ``skipped``); a subclass adds its own counters with `add_counts`."""
        q = self.puts
        return TierStats(add_counts({"puts_written": q.num_written, "bytes_written": q.num_bytes_written,
                                     "puts_failed": q.num_failed, "puts_dropped": q.num_dropped,
                                     "too_large": q.num_too_large, "no_room": q.num_no_room},
                                    q.fault_counts()),
                         {"puts_pending": len(q)})

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.puts.close(self.close_timeout)
        self._close()
