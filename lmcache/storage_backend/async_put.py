"""`AsyncPutQueue`: the write-behind queue of a lower tier (disk, remote), written once.

- `submit(key, obj)` queues `write(key, obj)` on a small worker pool and returns its Future. The
  queue holds a reference on `obj` (`ref_count_up`) until the write has finished or was cancelled,
  so the hot tier cannot recycle the buffer under a write.
- A key already in flight is not queued twice: `submit` returns the existing Future.
- At most `max_pending` writes are in flight; beyond that `submit` drops the put (returns None,
  counts it in `num_dropped`) instead of blocking the engine: capacity, not a failure, summarized
  at most once per interval (`observability.CapacityLog`).
- `get_pending(key)` hands out the in-flight object (with a reference for the caller), so a read
  that races a write is served from memory.
- `flush(timeout)` waits for everything in flight; `close(timeout)` stops accepting, flushes with
  that bounded wait, then cancels what is still queued.
A write is a call into the queue's failure domain (`lmcache.failures`, named after the queue): a
write that raises is a fault of that domain (counted in its ``failures``, logged once per
incident), and while it backs off, writes are not attempted (its ``skipped``); `fault_counts()`
reports both. A write may raise `DomainFault` instead: a failure domain inside the tier (a node of
a cluster) caught, counted and logged the fault, so the queue only accounts for the put. Either
way a put that failed is counted in `num_failed`, one not attempted in `num_dropped`, and only a
put that was written in `num_written` / `num_bytes_written`. A write that raises `NoRoom` (the
store has no room for it: capacity, not a fault) is dropped too, counted in `num_too_large` (for
`TooLarge`: larger than the whole store) or `num_no_room` as well, summarized like a full queue.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from lmcache.cache_key import CacheEngineKey
from lmcache.failures import DomainFault, FailureDomains, NoRoom, TooLarge
from lmcache.memory_management import MemoryObj
from lmcache.observability import CapacityLog

logger = logging.getLogger(__name__)

WriteFn = Callable[[CacheEngineKey, MemoryObj], None]


class AsyncPutQueue:
    def __init__(self, name: str, write: WriteFn, *, num_workers: int = 2, max_pending: int = 64,
                 faults: FailureDomains | None = None) -> None:
        """`faults`: where the writes' failure domain (named `name`) lives (by default the
        queue's own, backing off from 0.5 s up to 30 s)."""
        if num_workers < 1 or max_pending < 1:
            raise ValueError(f"num_workers={num_workers} and max_pending={max_pending} must be >= 1")
        self.name = name
        self.max_pending = max_pending
        self._write = write
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix=f"lmcache-{name}-put")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever a write is accounted for
        self._pending: dict[CacheEngineKey, tuple[Future, MemoryObj]] = {}
        self._closed = False
        self._faults = faults or FailureDomains(lambda domain: f"asynchronous writes to {domain}")
        self._full = CapacityLog(logger, f"{name}: the write queue was full ({max_pending} in flight)",
                                 "puts dropped, in num_dropped")  # capacity, not a failure
        self._no_room = CapacityLog(logger, f"{name}: the store had no room for a put",
                                    "puts dropped, in num_too_large / num_no_room")
        self.num_written = 0
        self.num_bytes_written = 0
        self.num_failed = 0
        self.num_dropped = 0
        self.num_too_large = 0
        self.num_no_room = 0

    def __len__(self) -> int:
        return len(self._pending)

    def contains(self, key: CacheEngineKey) -> bool:
        return key in self._pending

    def submit(self, key: CacheEngineKey, obj: MemoryObj) -> Future | None:
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:
                return pending[0]
            if self._closed or len(self._pending) >= self.max_pending:
                self.num_dropped += 1
                if self._closed:
                    logger.debug("%s: a put after close is dropped", self.name)
                else:
                    self._full.note(1)
                return None
            obj.ref_count_up()
            future = self._executor.submit(self._attempt, key, obj)
            self._pending[key] = (future, obj)
        future.add_done_callback(partial(self._finish, key, obj))
        return future

    def _attempt(self, key: CacheEngineKey, obj: MemoryObj) -> str:
        """Write through the failure domain: "written", "failed", "skipped" (backing off),
        "too_large" or "no_room" (refused by the store for lack of room)."""
        try:
            self._faults.run(self.name, partial(self._write, key, obj))
        except DomainFault as fault:
            return "skipped" if fault.skipped else "failed"
        except TooLarge:
            return "too_large"
        except NoRoom:
            return "no_room"
        return "written"

    def fault_counts(self) -> dict[str, float]:
        """``failures`` and ``skipped`` of the queue's own failure domain."""
        return self._faults.counts(self.name)

    def _finish(self, key: CacheEngineKey, obj: MemoryObj, future: Future) -> None:
        outcome = "skipped" if future.cancelled() else future.result()
        with self._lock:
            if self._pending.get(key, (None,))[0] is future:
                del self._pending[key]
            obj.ref_count_down()
            if outcome == "written":
                self.num_written += 1
                self.num_bytes_written += obj.get_size()
            elif outcome == "failed":
                self.num_failed += 1
            else:
                self.num_dropped += 1
                self.num_too_large += outcome == "too_large"
                self.num_no_room += outcome == "no_room"
            self._idle.notify_all()
        if outcome in ("too_large", "no_room"):
            self._no_room.note(1)

    def get_pending(self, key: CacheEngineKey) -> MemoryObj | None:
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                return None
            obj = pending[1]
            obj.ref_count_up()
            return obj

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no write is in flight (each finished and accounted for in the counters);
        False if `timeout` ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
        if not self.flush(timeout):
            logger.warning("%s: %d writes did not finish within %.1f s and are abandoned",
                           self.name, len(self._pending), timeout)
        self._executor.shutdown(wait=False, cancel_futures=True)
