"""`FailureDomains`: a failing store costs one attempt per backoff delay and one warning per
incident, for each part of it that fails on its own.

A failure domain is what fails together: a whole server, one node of a cluster, one peer. `call`
runs an operation against a domain: while the domain is backing off it answers `default` at once
(counted in `num_skipped`); an exception is a failure (`default`, backoff doubled, a warning on
the first failure of an incident, debug logs after); a success ends the incident. Exceptions
listed in `passthrough` (the store answered, but with a bad value) are raised to the caller.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from lmcache.backoff import Backoff
from lmcache.observability import IncidentLog

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Domain:
    def __init__(self, label: str, initial: float, maximum: float) -> None:
        self.backoff = Backoff(initial, maximum)
        self.incidents = IncidentLog(logger, label)


class FailureDomains:
    def __init__(self, label: Callable[[str], str], initial: float = 0.5, maximum: float = 30.0,
                 passthrough: tuple[type[BaseException], ...] = ()) -> None:
        """`label(domain)` names a domain in log lines."""
        self._label = label
        self._range = (initial, maximum)
        self._passthrough = passthrough
        self._lock = threading.Lock()
        self._domains: dict[str, _Domain] = {}
        self.num_skipped = 0

    def _get(self, name: str) -> _Domain:
        with self._lock:
            domain = self._domains.get(name)
            if domain is None:
                domain = self._domains[name] = _Domain(self._label(name), *self._range)
            return domain

    def call(self, name: str, fn: Callable[[], T], default: T) -> T:
        domain = self._get(name)
        if not domain.backoff.ready():
            with self._lock:
                self.num_skipped += 1
            return default
        try:
            result = fn()
        except self._passthrough:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the store is a miss
            domain.backoff.failed()
            domain.incidents.fail(e)
            return default
        if domain.backoff.failing:
            domain.backoff.succeeded()
            domain.incidents.recover()
        return result

    def ready(self, name: str) -> bool:
        """Whether domain `name` may be tried now (not within a backoff delay)."""
        with self._lock:
            domain = self._domains.get(name)
        return domain is None or domain.backoff.ready()

    def failing(self, name: str | None = None) -> bool:
        """Whether domain `name` (any domain, for None) is failing (being backed off from)."""
        with self._lock:
            domains = [self._domains[name]] if name in self._domains else [] if name else list(
                self._domains.values())
        return any(d.backoff.failing for d in domains)
