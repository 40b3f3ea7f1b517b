"""Counters an operator wants to see, and once-per-incident logging."""

from __future__ import annotations

import logging
import threading
from collections import Counter


class EngineStats:
    """Thread-safe named counters (tokens stored, hit, errors, ...) and time accumulators
    (seconds spent storing, retrieving; names end in ``_s``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._seconds: dict[str, float] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def add_time(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def get(self, name: str) -> int:
        return self._counts[name]

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {**self._counts, **self._seconds}


class IncidentLog:
    """Logs a failure once per incident: the first `fail` after a `recover` (or the start) warns,
    repeats are debug-level until the component works again."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what
        self._failing = False
        self.incidents = 0

    def fail(self, error: BaseException | str) -> None:
        if not self._failing:
            self._failing = True
            self.incidents += 1
            self._logger.warning("%s failed (treated as a cache miss): %s", self._what, error)
        else:
            self._logger.debug("%s still failing: %s", self._what, error)

    @property
    def failing(self) -> bool:
        return self._failing

    def recover(self) -> None:
        if self._failing:
            self._failing = False
            self._logger.info("%s works again", self._what)
