"""Pins and lookup leases: chunks counted by a lookup stay cached until they are loaded.

A serving engine asks "how many prefix tokens are cached?" well before it loads them; in between,
eviction must not drop those chunks, in whichever tier they are.

- `PinTable`: pin counts by key, shared by the tiers. A tier that evicts (the hot tier, the disk
  tier) skips pinned keys. A pin is by key, not by copy: a chunk pinned while on disk only is
  also protected once a prefetch has brought it into the hot tier. (A remote store's own eviction
  cannot be stopped from here; a lease prefetches remote chunks into the hot tier, where the pin
  holds.)
- `LeaseTable`: `acquire(lease_id, keys, ttl)` pins `keys` under the lease (acquiring the same id
  again replaces its keys, so repeated lookups are idempotent); `release(lease_id)` unpins them; a
  lease not released within `ttl` seconds expires (checked on every call), so a lost release can
  never pin memory forever.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

from lmcache.cache_key import CacheEngineKey


class PinTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[CacheEngineKey] = Counter()

    def __len__(self) -> int:
        return len(self._counts)

    def pin(self, keys: Iterable[CacheEngineKey]) -> None:
        with self._lock:
            self._counts.update(keys)

    def unpin(self, keys: Iterable[CacheEngineKey]) -> None:
        with self._lock:
            for key in keys:
                n = self._counts[key] - 1
                if n > 0:
                    self._counts[key] = n
                else:
                    del self._counts[key]

    def is_pinned(self, key: CacheEngineKey) -> bool:
        return key in self._counts

    def count(self, key: CacheEngineKey) -> int:
        """How many holders pin `key` (0: it is not pinned)."""
        with self._lock:
            return self._counts.get(key, 0)

    def pinned(self) -> list[CacheEngineKey]:
        with self._lock:
            return list(self._counts)


class LeaseTable:
    def __init__(self, pins: PinTable, clock: Callable[[], float] = time.monotonic) -> None:
        self._pins = pins
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[float, list[CacheEngineKey]]] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def acquire(self, lease_id: str, keys: list[CacheEngineKey], ttl: float) -> None:
        with self._lock:
            self._pins.pin(keys)  # before old pins go: a key pinned before and after is never unpinned
            self._expire_locked()
            self._release_locked(lease_id)
            self._leases[lease_id] = (self._clock() + ttl, list(keys))

    def release(self, lease_id: str) -> None:
        with self._lock:
            self._release_locked(lease_id)
            self._expire_locked()

    def close(self) -> None:
        with self._lock:
            for lease_id in list(self._leases):
                self._release_locked(lease_id)

    def _release_locked(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._pins.unpin(lease[1])

    def _expire_locked(self) -> None:
        now = self._clock()
        for lease_id in [i for i, (deadline, _) in self._leases.items() if deadline <= now]:
            self._release_locked(lease_id)
