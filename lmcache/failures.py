"""The failure policy: a cache never fails a request and never takes the serving engine down.

Every fault is one of three kinds, and each kind is caught in exactly one place:

1. **A store that fails** — a disk that errors, a remote server or cluster node that is down, a
   peer that does not answer, the peer lookup service unreachable. Connectors (the wire to a
   store: `storage_backend/connectors`, the lm:// client, `disk_file`) raise; none keeps a
   backoff or answers a miss of its own. The fault is caught, counted and logged once, by
   `FailureDomains.run` / `.call` (here) of the failure domain it happened in: what fails
   together (a tier, a cluster node, a peer, the lookup service). While a domain is failing it is
   backed off from (`backoff.Backoff`: one call per delay is made, the others are not, counted in
   ``skipped``); each failure is counted (``failures``); the first of an incident is one warning
   naming the domain, repeats are debug lines, and an incident that flaps (fails, works, fails
   ...) warns at most once per `observability.LOG_INTERVAL`, saying how many incidents it did not
   log (`observability.IncidentLog`). `call` answers the miss; `run` raises `DomainFault` (naming the
   domain) instead, and every guard outside passes a `DomainFault` on without counting or logging
   it again. The guards:
   - the `StorageManager`, around every call into a tier that `may_fail` (one domain per tier);
   - a lower tier's `AsyncPutQueue`, around its background writes (one domain per queue): a put
     that failed is counted in ``puts_failed``, one not attempted in ``puts_dropped``, and only a
     put that was written in ``puts_written`` / ``bytes_written``;
   - inside a tier whose one batch spans several domains, so that a dead one costs only its
     share: `RemoteBackend` per node of the store (a read answers that node's keys as misses, a
     write raises the `DomainFault` to its put queue), `PeerBackend` per peer (a peer backing off
     is routed around, counted as skipped) and the peer `LookupService` for its store;
   - the cache-server client (`cache_server/client.py`), one domain for its server: its requests
     `run` through it; while it is detached a request is not made (`skip`, counted in
     ``skipped``), and its attaches and heartbeats are the domain's `probe`s, made on the
     client's schedule (every heartbeat; once, for 0.2 s, by a request that is safe to repeat)
     instead of the backoff's, not counted, and ending the incident when one works;
   - the PD sender (`pd/sender.py`), one domain per KV receiver: a send that failed or was not
     made while the receiver is backed off from sends nothing (the decoder computes the KV).
   A tier's ``failures`` / ``skipped`` in its stats are the sum over the guards that cover it
   (`observability.add_counts`: merged, never replaced); the PD sender's are the engine's
   ``pd_send_failures`` / ``pd_send_skipped`` (`EngineStats.include`). Exceptions a domain lists in
   `passthrough` (the store answered, with a bad value: `CorruptBlobError`) reach the tier that
   reads them, which deletes the value and counts it.
2. **A bug** — anything else raised while serving a request (a copy into the serving engine that
   fails, a broken invariant). With ``error_handling=True``, `BugsAsMisses.call` (here) makes it a
   miss for that request: counted in the engine's ``errors``, logged once per incident with the
   traceback; with False it propagates. An engine has one, used by its store and retrieve and by
   whatever serves requests through it (the vLLM worker's load and save, which always run with
   ``error_handling=True``).
3. **Bad input** — a mask, shape, search range, config, URL or command that cannot be right: a
   specific ValueError at the boundary, always, whatever ``error_handling`` says. Bad bytes read
   from a store (corrupt, truncated, foreign) are a miss, never an error.

Servers (the lm:// server, the controller, the vLLM lookup channel, the peer server) answer a bad
or failing request with an error reply and keep serving; a client whose server does not answer
counts a miss (the vLLM lookup channel asks again on the next scheduler step, without backoff).
Something that does not change while the process runs (a setting, a missing device) is logged
once per process with `observability.log_once`; running out of room is capacity, not a failure:
counted and summarized at most once per interval (`observability.CapacityLog`, info level) — a
CPU arena full of KV in use (stores keep fewer chunks: ``store_dropped_tokens``), a full put
queue (``puts_dropped``), a write a store refuses for lack of room (`NoRoom`, which no failure
domain counts: the put queue counts the put in ``puts_dropped`` and in ``too_large`` or
``no_room``), a PD receive buffer still full after ``pd_send_timeout`` (the rest is not sent:
``pd_skipped_bytes``); every other repeated warning is an incident.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from lmcache.backoff import Backoff, Clock
from lmcache.observability import Counters, IncidentLog

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DomainFault(Exception):
    """A call into failure domain `domain` (its label) was not made (`skipped`: backing off) or
    failed (the cause is ``__cause__``). It has been counted and logged by that domain already:
    whoever catches it answers its miss without counting or logging it again."""

    def __init__(self, domain: str, skipped: bool) -> None:
        super().__init__(f"{domain}: {'backing off, not tried' if skipped else 'failed'}")
        self.domain = domain
        self.skipped = skipped


class NoRoom(Exception):
    """A store refused a write for lack of room (what it holds may not be evicted now): capacity,
    not a failure of the store. A failure domain passes it on untouched."""


class TooLarge(NoRoom):
    """A store refused a write because the value is larger than all of its room."""


class _Domain:
    def __init__(self, label: str, initial: float, maximum: float, clock: Clock, consequence: str) -> None:
        self.label = label
        self.backoff = Backoff(initial, maximum, clock)
        self.incidents = IncidentLog(logger, label, consequence=consequence, clock=clock)


class FailureDomains:
    """`call(name, fn, default)` runs `fn()` against domain `name`: while the domain is backing
    off it answers `default` at once (counted in ``skipped``); an exception is a failure
    (`default`, counted in ``failures``, backoff doubled, a warning on the first failure of an
    incident); a success ends the incident. `run(name, fn)` is the same but raises `DomainFault`
    where `call` answers `default`. For an owner that tracks whether the domain is up itself (a
    client attached or not): `probe` (a check made whatever the backoff, not counted) and `skip`
    (a call it did not make). Domains are created on first use."""

    def __init__(self, label: Callable[[str], str], initial: float = 0.5, maximum: float = 30.0,
                 passthrough: tuple[type[BaseException], ...] = (), clock: Clock = time.monotonic,
                 consequence: str = "treated as a cache miss") -> None:
        """`label(domain)` names a domain in log lines, `consequence` what its failure means."""
        Backoff(initial, maximum)  # validates the range now, not at the first failure
        self._label = label
        self._range = (initial, maximum)
        self._clock = clock
        self._passthrough: tuple[type[BaseException], ...] = (DomainFault, NoRoom, *passthrough)
        self._consequence = consequence
        self._lock = threading.Lock()
        self._domains: dict[str, _Domain] = {}
        self._counts: dict[str, Counters] = {}

    def _get(self, name: str) -> _Domain:
        with self._lock:
            domain = self._domains.get(name)
            if domain is None:
                domain = self._domains[name] = _Domain(self._label(name), *self._range, self._clock,
                                                             self._consequence)
                self._counts[name] = Counters()
            return domain

    def run(self, name: str, fn: Callable[[], T]) -> T:
        """`fn()` against domain `name`; raises `DomainFault` if the domain is backing off (the call
        is not made: counted in ``skipped``) or `fn` fails (counted in ``failures``, backoff
        doubled, a warning on the first failure of an incident). A `DomainFault` that `fn` raises
        (from a domain inside it), a `NoRoom` (a store that answered it has no room: capacity) and
        the `passthrough` exceptions propagate untouched."""
        domain = self._get(name)
        if not domain.backoff.claim_attempt():  # while failing, one call per delay is made
            self._counts[name].add("skipped")
            raise DomainFault(domain.label, skipped=True)
        return self._attempt(name, domain, fn, counted=True)

    def probe(self, name: str, fn: Callable[[], T]) -> T:
        """`fn()` against domain `name` even while it is backing off: its owner's own check whether
        the domain works, made on the owner's schedule rather than the backoff's (the cache-server
        client's attach and heartbeat). As `run`, but a failure is not counted in ``failures`` (no
        request failed on it): it is logged as part of the incident (a warning if it starts one),
        and it raises `DomainFault`."""
        return self._attempt(name, self._get(name), fn, counted=False)

    def _attempt(self, name: str, domain: _Domain, fn: Callable[[], T], counted: bool) -> T:
        try:
            result = fn()
        except self._passthrough:
            raise
        except Exception as e:  # any failure of the store is a fault of the domain
            if counted:
                self._counts[name].add("failures")
            domain.backoff.failed()
            domain.incidents.fail(e)
            raise DomainFault(domain.label, skipped=False) from e
        if domain.backoff.failing:
            domain.backoff.succeeded()
            domain.incidents.recover()
        return result

    def call(self, name: str, fn: Callable[[], T], default: T) -> T:
        """`run(name, fn)`, with `default` (the miss) for a `DomainFault`, this domain's or one
        raised inside `fn` (already counted and logged where it was raised: not again here)."""
        try:
            return self.run(name, fn)
        except DomainFault:
            return default

    def counts(self, name: str | None = None) -> dict[str, float]:
        """``failures`` and ``skipped`` calls of domain `name` (summed over every domain, for
        None)."""
        with self._lock:
            chosen = [self._counts[name]] if name in self._counts else [] if name else list(
                self._counts.values())
        out = {"failures": 0.0, "skipped": 0.0}
        for counts in chosen:
            for key, value in counts.snapshot().items():
                out[key] += value
        return out

    @property
    def num_skipped(self) -> int:
        return int(self.counts()["skipped"])

    def ready(self, name: str) -> bool:
        """Whether domain `name` may be tried now (not within a backoff delay)."""
        with self._lock:
            domain = self._domains.get(name)
        return domain is None or domain.backoff.ready()

    def admit(self, name: str) -> bool:
        """`ready(name)`, counting a call not made (``skipped``) if it is not: for a caller that
        routes around a domain that is backing off instead of calling into it."""
        if self.ready(name):
            return True
        self.skip(name)
        return False

    def skip(self, name: str) -> None:
        """Count a call into domain `name` not made (``skipped``) because its owner knows the domain
        is down (a client detached from its server, which its `probe`s re-attach)."""
        self._get(name)
        self._counts[name].add("skipped")

    def failing(self, name: str | None = None) -> bool:
        """Whether domain `name` (any domain, for None) is failing (being backed off from)."""
        with self._lock:
            domains = [self._domains[name]] if name in self._domains else [] if name else list(
                self._domains.values())
        return any(d.backoff.failing for d in domains)


class BugsAsMisses:
    """An engine's handling of bugs (kind 2 above). `call(what, fn, default)` runs `fn()`; if it
    raises and `enabled`, the error is counted (`count()`), logged once per incident with its
    traceback, and `default` is returned; if not `enabled` it propagates. `failed(what, error)`
    reports an error caught elsewhere (a copy that failed after its call had returned)."""

    def __init__(self, log: logging.Logger, what: str, enabled: bool, count: Callable[[], None]) -> None:
        self.enabled = enabled
        self._count = count
        self._incidents = IncidentLog(log, what, with_traceback=True)

    def call(self, what: str, fn: Callable[[], T], default: T) -> T:
        try:
            result = fn()
        except Exception as e:
            if not self.enabled:
                raise
            self.failed(what, e)
            return default
        self._incidents.recover()
        return result

    def failed(self, what: str, error: BaseException) -> None:
        self._count()
        self._incidents.fail(RuntimeError(f"{what}: {type(error).__name__}: {error}").with_traceback(
            error.__traceback__))
