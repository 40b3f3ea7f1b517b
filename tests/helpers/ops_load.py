"""An engine attached to a cache server, timed while an operator asks the server's operations
endpoint and while nobody does (`interleaved_rounds`).

The engine's requests go through its cache-server client, on a tiny model (the unit tests'
`engine_worker` engine: 2 layers, 8-token chunks):

- ``store``: one fresh chunk: the client reserves a slot, the chunk is written into it and
  committed (what `engine.store` does after its check that the chunk is not stored yet, a check
  that asks every tier of the server, a slow remote one included, whoever else is asking);
- ``retrieve``: `engine.retrieve` of a document the server's L1 holds (one ``get``, the copy, the
  reads released with the next request);
- ``lookup``: a leased `engine.lookup` of that document and the lease's release, as the vLLM
  connector's scheduler asks (``contains``, ``lease``, ``unlease``).

A round runs the same requests twice, once while an operator lookup (``POST /lookup`` of a document
the server does not hold, so that it waits on every lower tier) is in flight and once without one;
the order of the two flips every round, so both see the same machine. Requests are due at a fixed
interval and timed from when they were due, so a server that holds one request up is charged for
every request that arrived meanwhile (not only for the first).
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.cache_server.client import CacheServerClient
from lmcache.memory_management import MemoryFormat, release_all
from tests.unit.cache_server.engine_worker import CHUNK, HIDDEN, LAYERS, kv_cache

OPS = ("store", "retrieve", "lookup")
LEAD = 0.1  # seconds between sending the operator lookup and the engine's first request


def operator_lookup(http: str, tokens: list[int]) -> dict:
    """``POST /lookup`` of `tokens` at the operations endpoint `http`."""
    request = urllib.request.Request(http + "/lookup", data=json.dumps({"tokens": tokens}).encode(),
                                     method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


class OperatorLookup(threading.Thread):
    """One `operator_lookup` in a thread of its own: `sent` is set as it is sent; `sent_at`,
    `answered_at` (time.monotonic) and `error` once it is joined."""

    def __init__(self, http: str, tokens: list[int]) -> None:
        super().__init__(name="operator-lookup")
        self.http, self.tokens = http, tokens
        self.sent = threading.Event()
        self.sent_at = self.answered_at = 0.0
        self.error: Exception | None = None

    def run(self) -> None:
        self.sent_at = time.monotonic()
        self.sent.set()
        try:
            operator_lookup(self.http, self.tokens)
        except Exception as e:  # noqa: BLE001 - raised by the thread that joins this one
            self.error = e
        self.answered_at = time.monotonic()


@dataclass
class Rounds:
    """Seconds per engine request, by op: `quiet` without an operator lookup in flight, `busy`
    with one; `operator`: each operator lookup's seconds; `overlapped`: every busy request ended
    before the operator lookup it ran beside."""

    quiet: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    busy: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    operator: list[float] = field(default_factory=list)
    overlapped: bool = True

    def medians_ms(self, busy: bool) -> dict[str, float]:
        """Median ms per op, and over every request ("all")."""
        runs = self.busy if busy else self.quiet
        out = {op: 1e3 * statistics.median(runs[op]) for op in OPS}
        out["all"] = 1e3 * statistics.median([s for op in OPS for s in runs[op]])
        return out

    def added_ms(self) -> dict[str, float]:
        """Busy median minus quiet median, in ms, per op and over every request."""
        busy, quiet = self.medians_ms(True), self.medians_ms(False)
        return {op: busy[op] - quiet[op] for op in busy}


class EngineRequests:
    """The requests of `engine` (attached to a cache server) that `interleaved_rounds` times;
    `doc` must be stored first (`prepare`)."""

    def __init__(self, engine: LMCacheEngine, doc: list[int]) -> None:
        if not isinstance(engine.memory_allocator, CacheServerClient):
            raise ValueError("the engine is not attached to a cache server (cache_server_url)")
        self.engine = engine
        self.client = engine.memory_allocator
        self.doc = torch.tensor(doc, dtype=torch.int64)
        self.target = kv_cache(None)
        self._fresh = itertools.count(10_000_000, CHUNK)

    def prepare(self, seed: int) -> None:
        self.engine.store(self.doc, kvcaches=kv_cache(seed))
        if self.engine.lookup(self.doc) != len(self.doc):
            raise AssertionError("the document was not stored on the server")

    def store(self) -> None:
        start = next(self._fresh)
        (chunk,) = self.engine.token_database.process_tokens(torch.arange(start, start + CHUNK))
        objs = self.client.allocate_many([torch.Size([2, LAYERS, CHUNK, HIDDEN])], torch.bfloat16,
                                         MemoryFormat.KV_BLOB)
        if not objs:
            raise AssertionError("the server's L1 had no slot for a chunk")
        objs[0].tensor.fill_(1.0)
        self.client.commit([chunk.key], objs)
        release_all(objs)

    def retrieve(self) -> None:
        hit = int(self.engine.retrieve(self.doc, kvcaches=self.target).sum())
        if hit != len(self.doc):
            raise AssertionError(f"retrieved {hit} of {len(self.doc)} tokens")

    def lookup(self) -> None:
        if self.engine.lookup(self.doc, lease_id="ops-load") != len(self.doc):
            raise AssertionError("the leased lookup missed the document")
        self.engine.release("ops-load")

    def timed(self, per_op: int, interval: float) -> tuple[dict[str, list[float]], float]:
        """`per_op` rounds of store, retrieve, lookup, one request due every `interval` seconds
        (an open loop, as requests arrive at a server: a request held up also delays the ones due
        after it, and their wait counts): seconds from each request's due time to its end, by op,
        and when the last one ended (time.monotonic)."""
        calls: dict[str, Callable[[], None]] = {"store": self.store, "retrieve": self.retrieve,
                                                "lookup": self.lookup}
        seconds: dict[str, list[float]] = {op: [] for op in OPS}
        start = time.perf_counter()
        for i, op in enumerate(op for _ in range(per_op) for op in OPS):
            due = start + i * interval
            time.sleep(max(0.0, due - time.perf_counter()))
            calls[op]()
            seconds[op].append(time.perf_counter() - due)
        return seconds, time.monotonic()


def interleaved_rounds(http: str, requests: EngineRequests, operator_tokens: list[int], rounds: int,
                       per_op: int, interval: float = 0.02) -> Rounds:
    """`rounds` rounds of `requests.timed(per_op, interval)` with and without an operator lookup
    of `operator_tokens` in flight (see the module docstring)."""
    out = Rounds()
    for r in range(rounds):
        for busy in ((True, False) if r % 2 else (False, True)):
            operator = OperatorLookup(http, operator_tokens) if busy else None
            if operator is not None:
                operator.start()
                operator.sent.wait()
                time.sleep(LEAD)  # the server is waiting on its lower tiers for the operator by now
            seconds, last = requests.timed(per_op, interval)
            if operator is not None:
                operator.join()
                if operator.error is not None:
                    raise operator.error
                out.operator.append(operator.answered_at - operator.sent_at)
                out.overlapped &= last < operator.answered_at
            for op in OPS:
                (out.busy if busy else out.quiet)[op] += seconds[op]
    return out
