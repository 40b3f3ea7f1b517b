"""`Backoff`: after a failure, do not try again until a growing delay has passed.

Used by everything that talks to a store that can fail, through `failures.FailureDomains` (the
PD proxy keeps one per engine it routes to), so that a dead server costs one failed attempt per
delay, not one per request. `ready()` says whether an attempt may be made now; `claim_attempt()`
also takes it: while failing, the one attempt of a delay (others are not ready until its outcome,
or until another delay passed, if it hangs); `failed()` doubles the delay (from `initial` up to
`maximum`); `succeeded()` resets it. `clock` (seconds, monotonic)
is injectable so tests step time instead of sleeping. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Clock = Callable[[], float]


class Backoff:
    def __init__(self, initial: float = 0.5, maximum: float = 30.0, clock: Clock = time.monotonic) -> None:
        if not 0 < initial <= maximum:
            raise ValueError(f"backoff delays must satisfy 0 < initial={initial} <= maximum={maximum}")
        self.initial = initial
        self.maximum = maximum
        self._clock = clock
        self._lock = threading.Lock()
        self._delay = 0.0
        self._retry_at = 0.0

    def ready(self) -> bool:
        return self._clock() >= self._retry_at

    def claim_attempt(self) -> bool:
        """`ready()`; while failing, the attempt it admits is then the only one until it fails or
        succeeds or another delay passes (concurrent callers do not all retry a dead store at once)."""
        with self._lock:
            now = self._clock()
            if now < self._retry_at:
                return False
            if self._delay > 0:
                self._retry_at = now + self._delay
            return True

    @property
    def failing(self) -> bool:
        return self._delay > 0

    def failed(self) -> float:
        """Record a failure; returns the delay before the next attempt."""
        with self._lock:
            self._delay = self.initial if self._delay == 0 else min(self._delay * 2, self.maximum)
            self._retry_at = self._clock() + self._delay
            return self._delay

    def succeeded(self) -> None:
        with self._lock:
            self._delay = 0.0
            self._retry_at = 0.0
