"""Numbers an operator wants to see, and once-per-incident logging.

- `Counters`: named monotonic counters, safe to bump from any thread.
- `Histogram`: fixed buckets (cumulative counts and sum, for a scrape) plus the observations made
  since the last `drain` (for shipping to another process, e.g. vLLM's metrics logger; at most the
  last UNDRAINED_MAX, so that one nobody drains stays small).
- `TierStats`: what one storage tier reports: counters (monotonic) and gauges (current values).
- `EngineStats`: the one place an engine's numbers are gathered: its own counters, times and
  histograms, and — read when asked — its tiers' `TierStats` and the counters of components
  that serve through it and keep their own (the PD sender: `include`). `interval()` is what
  changed since the previous call (counter increments, current gauges, new observations) as
  plain JSON-able data; `metrics.py` turns either view into Prometheus metrics.
- `IncidentLog`: a failure is logged once per incident (a warning, with the traceback if there is
  one), then at debug level until the component works again; an incident that flaps warns at most
  once per `LOG_INTERVAL`, the next warning saying how many incidents went unlogged.
- `CapacityLog`: running out of room (a CPU arena full of KV in use) is capacity, not a failure:
  counted, and summarized at most once per `LOG_INTERVAL` (info level).
- `add_counts`: tier counters from several owners, added up (merged, never replaced).
- `log_once`: a notice about something that does not change while the process runs (a setting, a
  missing device, a kind of bad input) is logged once per process. Every "warn once" in the
  package goes through one of these.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# seconds, and GB/s, of one store or retrieve
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
THROUGHPUT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
LOG_INTERVAL = 60.0  # seconds: the most often an incident (or a capacity summary) is logged
UNDRAINED_MAX = 10_000  # observations a histogram keeps for `drain` (nobody drains outside vLLM)
HISTOGRAMS = {"store_seconds": LATENCY_BUCKETS, "retrieve_seconds": LATENCY_BUCKETS,
              "store_gbps": THROUGHPUT_BUCKETS, "retrieve_gbps": THROUGHPUT_BUCKETS}


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def get(self, name: str) -> float:
        with self._lock:
            return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self._lock = threading.Lock()
        self._counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._new: deque[float] = deque(maxlen=UNDRAINED_MAX)  # the oldest go; the buckets count all

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value
            self._new.append(value)

    def drain(self) -> list[float]:
        """The observations since the previous drain (the last UNDRAINED_MAX of them)."""
        with self._lock:
            new = list(self._new)
            self._new.clear()
            return new

    def cumulative(self) -> tuple[list[int], float]:
        """Counts of observations <= each bucket bound (and +Inf), and their sum."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        running, out = 0, []
        for c in counts:
            running += c
            out.append(running)
        return out, total


def add_counts(*counts: Mapping[str, float]) -> dict[str, float]:
    """The counters of `counts` added up, name by name (a counter two owners keep is summed)."""
    out: dict[str, float] = {}
    for c in counts:
        for name, value in c.items():
            out[name] = out.get(name, 0) + value
    return out


@dataclass
class TierStats:
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


class EngineStats:
    """`tiers()` reads the storage tiers' numbers (the storage manager's `stats`)."""

    def __init__(self, tiers: Callable[[], Mapping[str, TierStats]] | None = None) -> None:
        self._tiers = tiers or dict
        self._counters = Counters()
        self._included: list[Callable[[], Mapping[str, float]]] = []
        self._seconds = Counters()
        self.histograms = {name: Histogram(b) for name, b in HISTOGRAMS.items()}
        self._lock = threading.Lock()
        self._reported: dict[str, float] = {}  # counter values at the previous `interval`

    def add(self, name: str, n: int = 1) -> None:
        self._counters.add(name, n)

    def include(self, counters: Callable[[], Mapping[str, float]]) -> None:
        """Counters another component keeps (cumulative), read when asked and added to the
        engine's own (`add_counts`: merged, never replaced)."""
        self._included.append(counters)

    def _engine_counters(self) -> dict[str, float]:
        return add_counts(self._counters.snapshot(), *(read() for read in self._included))

    def add_time(self, name: str, seconds: float) -> None:
        self._seconds.add(name, seconds)

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def get(self, name: str) -> float:
        return self._engine_counters().get(name, 0)

    def snapshot(self) -> dict[str, float]:
        """The engine's counters (with those `include`d) and accumulated seconds (names ending in
        ``_s``)."""
        return {**self._engine_counters(), **self._seconds.snapshot()}

    def tiers(self) -> dict[str, TierStats]:
        return dict(self._tiers())

    def report(self) -> dict[str, Any]:
        """Everything as plain data: ``{"engine": counters and seconds, "tiers": {tier:
        {"counters": ..., "gauges": ...}}}``."""
        tiers = {name: {"counters": s.counters, "gauges": s.gauges} for name, s in self.tiers().items()}
        return {"engine": self.snapshot(), "tiers": tiers}

    def counters(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Every counter, cumulative: the engine's, and each tier's by tier name."""
        return self._engine_counters(), {name: s.counters for name, s in self.tiers().items()}

    def interval(self) -> dict[str, Any]:
        """What happened since the previous call: ``{"counters": {name: increment},
        "tier_counters": {tier: {name: increment}}, "tier_gauges": {tier: {name: value}},
        "observations": {histogram: [values]}}`` (zero increments left out)."""
        engine, tiers = self.counters()
        gauges = {name: s.gauges for name, s in self.tiers().items()}
        with self._lock:
            def delta(key: str, value: float) -> float:
                previous = self._reported.get(key, 0)
                self._reported[key] = value
                return value - previous

            counters = {k: d for k, v in engine.items() if (d := delta(k, v))}
            tier_counters = {t: {k: d for k, v in c.items() if (d := delta(f"{t}/{k}", v))}
                             for t, c in tiers.items()}
        return {"counters": counters, "tier_counters": {t: c for t, c in tier_counters.items() if c},
                "tier_gauges": gauges,
                "observations": {n: obs for n, h in self.histograms.items() if (obs := h.drain())}}


_logged_once: set[tuple[str, object]] = set()
_logged_once_lock = threading.Lock()


def log_once(logger: logging.Logger, key: object, msg: str, *args: object,
             level: int = logging.WARNING) -> bool:
    """Log `msg % args` (a warning unless `level` says otherwise) the first time `key` is seen by
    `logger` in this process. True if it was logged now."""
    with _logged_once_lock:
        if (logger.name, key) in _logged_once:
            return False
        _logged_once.add((logger.name, key))
    logger.log(level, msg, *args)
    return True


def forget_logged_once() -> None:
    """Let every `log_once` notice be logged again (tests that check one)."""
    with _logged_once_lock:
        _logged_once.clear()


class _Pace:
    """At most one event per `interval` seconds of `clock` (the caller holds its own lock)."""

    def __init__(self, interval: float, clock: Callable[[], float]) -> None:
        self._interval = interval
        self._clock = clock
        self._last: float | None = None

    def due(self) -> float | None:
        """None if the last event was under `interval` ago; else the seconds since it (inf for
        the first), and now is the last event."""
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            return None
        elapsed, self._last = (math.inf if self._last is None else now - self._last), now
        return elapsed


class IncidentLog:
    """Logs a failure once per incident: the first `fail` after a `recover` (or the start) warns
    (with the traceback if `with_traceback`: for failures that are bugs, not outages), repeats are
    debug-level until the component works again. An incident that flaps (fails, works, fails ...)
    warns at most once per `interval` seconds: the incidents in between are debug lines, and the
    next warning says how many there were. `consequence` says what the failure means for the caller
    ("treated as a cache miss" unless told otherwise)."""

    def __init__(self, logger: logging.Logger, what: str, *, with_traceback: bool = False,
                 consequence: str = "treated as a cache miss", interval: float = LOG_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._what = what
        self._consequence = consequence
        self._with_traceback = with_traceback
        self._interval = interval
        self._warnings = _Pace(interval, clock)
        self._lock = threading.Lock()
        self._failing = False
        self._warned = False  # whether the current incident was announced
        self._suppressed = 0  # incidents since the last warning that were not announced
        self.incidents = 0

    def fail(self, error: BaseException | str) -> None:
        warn, suppressed = False, 0
        with self._lock:
            new = not self._failing
            self._failing = True
            if new:
                self.incidents += 1
                warn = self._warned = self._warnings.due() is not None
                if warn:
                    suppressed, self._suppressed = self._suppressed, 0
                else:
                    self._suppressed += 1
        if warn:
            trace = error if self._with_traceback and isinstance(error, BaseException) else None
            more = (f" ({suppressed} more incidents in the last {self._interval:g} s were not logged)"
                    if suppressed else "")
            self._logger.warning("%s failed (%s): %s%s", self._what, self._consequence, error, more,
                                 exc_info=trace)
        else:
            self._logger.debug("%s %s: %s", self._what, "failed" if new else "still failing", error)

    @property
    def failing(self) -> bool:
        return self._failing

    def recover(self) -> None:
        with self._lock:
            if not self._failing:
                return
            self._failing = False
            announced = self._warned
        self._logger.log(logging.INFO if announced else logging.DEBUG, "%s works again", self._what)


class CapacityLog:
    """Something that runs out of room (not a failure): `note(amount)` counts one occurrence and
    logs at most one line per `interval` seconds (info level): the first occurrence at once, then a
    summary of how many occurrences (and how much `amount`) since the previous line."""

    def __init__(self, logger: logging.Logger, what: str, unit: str, *, interval: float = LOG_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._what = what
        self._unit = unit
        self._interval = interval
        self._lines = _Pace(interval, clock)
        self._lock = threading.Lock()
        self._times = 0
        self._amount = 0.0
        self.total = 0

    def note(self, amount: float) -> None:
        with self._lock:
            self.total += 1
            self._times += 1
            self._amount += amount
            elapsed = self._lines.due()
            if elapsed is None:
                return
            since = "" if elapsed == math.inf else f" in the last {elapsed:.0f} s"
            times, amount = self._times, self._amount
            self._times, self._amount = 0, 0.0
        self._logger.info("%s %d time(s)%s (%g %s; summarized at most once per %g s)", self._what,
                          times, since, amount, self._unit, self._interval)
