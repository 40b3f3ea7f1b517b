"""`ManualClock`: a monotonic clock that moves only when a test says so (injected wherever the code
takes a ``clock``: backoff, failure domains, leases), so tests step past a delay instead of
sleeping just past it."""

from __future__ import annotations


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
