"""Lookup leases: chunks counted by a lookup stay in the hot tier until they are loaded.

A serving engine asks "how many prefix tokens are cached?" well before it loads them; in between,
eviction must not drop those chunks. `acquire(lease_id, keys, ttl)` pins the hot-tier keys under
the lease (acquiring the same id again replaces its keys, so repeated lookups are idempotent);
`release(lease_id)` unpins them; a lease not released within `ttl` seconds expires (checked on
every call), so a lost release can never pin memory forever.
"""

from __future__ import annotations

import threading
import time

from lmcache.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.utils import CacheEngineKey


class LeaseTable:
    def __init__(self, hot: LocalCPUBackend, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self._hot = hot
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[float, list[CacheEngineKey]]] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def acquire(self, lease_id: str, keys: list[CacheEngineKey], ttl: float) -> int:
        """Pin those of `keys` that are hot; returns how many were pinned."""
        with self._lock:
            self._expire_locked()
            self._release_locked(lease_id)
            pinned = [k for k in keys if self._hot.pin(k)]
            self._leases[lease_id] = (self._clock() + ttl, pinned)
            return len(pinned)

    def release(self, lease_id: str) -> None:
        with self._lock:
            self._release_locked(lease_id)
            self._expire_locked()

    def _release_locked(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            for key in lease[1]:
                self._hot.unpin(key)

    def _expire_locked(self) -> None:
        now = self._clock()
        for lease_id in [i for i, (deadline, _) in self._leases.items() if deadline <= now]:
            self._release_locked(lease_id)
