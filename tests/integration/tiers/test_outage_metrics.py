"""What ``/metrics`` says while a store is down: an engine storing from two threads into a real
Valkey, a real lm:// server and a real peer process, each SIGKILLed mid-run and brought back.
Failures and skips rise during the outage, bytes written (for the peer: bytes read) do not, and
they rise again once the store is back."""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request

import pytest
import torch

from tests.helpers import WRITE_WAIT
from tests.helpers.paged_kv import PagedKV, build_engine
from tests.integration.tiers.peer_worker import peer_engine
from tests.integration.tiers.test_p2p import retrieve, start_peer

pytestmark = pytest.mark.integration
CHUNK = 8
DOC = 32  # tokens: 4 chunks
CHUNK_BYTES = 2 * 2 * CHUNK * 8 * 2  # [K/V, 2 layers, 8 tokens, hidden 8] bf16
TIER_COUNTER = re.compile(r'^lmcache:tier_(\w+)_total\{tier="(\w+)"\} (\S+)$', re.M)


def scrape(engine, tier: str) -> dict[str, float]:
    """The tier's counters as ``/metrics`` serves them."""
    url = f"http://127.0.0.1:{engine.metrics_server.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {name: float(v) for name, t, v in TIER_COUNTER.findall(text) if t == tier}


def report(what: str, phases: dict[str, dict[str, float]], moved: str) -> None:
    """The figures of one outage, printed (``pytest -s``) for benchmarks/RESULTS.md."""
    names = ("failures", "skipped", "puts_failed", "puts_dropped", moved)
    print(f"\n{what}: " + "; ".join(f"{phase} " + " ".join(f"{n}={int(c.get(n, 0))}" for n in names)
                                     for phase, c in phases.items()))


def store_docs(engine, seeds: range) -> None:
    """Store a document per seed from two threads at once, then wait for the remote writes."""
    def run(part: range) -> None:
        for seed in part:
            kv = PagedKV(num_blocks=16)
            tokens = torch.randint(0, 30000, (DOC,), generator=torch.Generator().manual_seed(seed))
            engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(DOC))

    threads = [threading.Thread(target=run, args=(seeds[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.storage_manager.backends["RemoteBackend"].puts.flush(WRITE_WAIT)


class Store:
    """A real store that the test kills (SIGKILL) and starts again on the same port."""

    def __init__(self, request, kind: str) -> None:
        self.kind = kind
        if kind == "valkey":
            self.valkey = request.getfixturevalue("valkey")
            self.url = self.valkey.url
        else:
            self.start_lm = request.getfixturevalue("lm_server")
            self.lm = self.start_lm()
            self.url = self.lm.url

    def kill(self) -> None:
        if self.kind == "valkey":
            self.valkey.kill()
        else:
            self.lm.stop(signal.SIGKILL)

    def restart(self) -> None:
        if self.kind == "valkey":
            self.valkey.start()
        else:
            self.lm = self.start_lm(port=self.lm.port)


@pytest.mark.parametrize("kind", ["valkey", "lm"])
def test_a_killed_remote_store_shows_failures_and_skips_not_bytes_written(request, kind):
    store = Store(request, kind)
    engine = build_engine(CHUNK, cpu_bytes=4 << 20, metrics_port=0, remote_timeout=1.0,
                          remote_url=store.url + "?backoff=0.5&max_backoff=0.5")
    try:
        store_docs(engine, range(0, 8))
        before = scrape(engine, "RemoteBackend")
        assert before["puts_written"] == 32 and before["bytes_written"] == 32 * CHUNK_BYTES
        assert before.get("failures", 0) == 0 and before.get("skipped", 0) == 0

        store.kill()
        store_docs(engine, range(8, 16))
        during = scrape(engine, "RemoteBackend")
        assert during["bytes_written"] == before["bytes_written"]  # nothing could be written
        assert during["puts_written"] == before["puts_written"]
        assert during["failures"] >= 1 and during["skipped"] >= 1  # then backed off
        assert during["puts_failed"] + during["puts_dropped"] == 32
        assert during["puts_failed"] == during["failures"]  # every fault counted once

        store.restart()
        deadline = time.monotonic() + 10
        seed = 100
        while scrape(engine, "RemoteBackend")["puts_written"] == during["puts_written"]:
            assert time.monotonic() < deadline, "writes did not resume"
            time.sleep(0.1)
            store_docs(engine, range(seed, seed + 1))  # a doc per try, until one is written
            seed += 1
        resumed = scrape(engine, "RemoteBackend")
        store_docs(engine, range(16, 24))
        after = scrape(engine, "RemoteBackend")
        assert after["bytes_written"] - resumed["bytes_written"] == 32 * CHUNK_BYTES
        assert (after["failures"], after["skipped"]) == (resumed["failures"], resumed["skipped"])
        report(kind, {"before": before, "during": during, "after": after}, "bytes_written")
        engine.storage_manager.clear("hot")
        assert engine.lookup(torch.randint(0, 30000, (DOC,), generator=torch.Generator().manual_seed(16))) \
            == DOC  # served by the store again
    finally:
        engine.close()


def test_a_killed_peer_shows_failures_and_skips_not_bytes_read(valkey):
    lookup = valkey.url
    proc, _ = start_peer(lookup, 1.0, "1:32", "2:32", "3:32", "4:32")
    engine = peer_engine(lookup, 1.0, metrics_port=0, cpu_bytes=4 << 20)
    fresh = None
    try:
        assert retrieve(engine, 1, DOC) == DOC
        before = scrape(engine, "PeerBackend")
        assert before["hits"] == 4 and before["bytes_read"] == 4 * CHUNK_BYTES
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert [retrieve(engine, seed, DOC) for seed in (2, 3, 4)] == [0, 0, 0]  # registered, dead
        during = scrape(engine, "PeerBackend")
        assert during["bytes_read"] == before["bytes_read"] and during["hits"] == before["hits"]
        assert during["failures"] >= 1 and during["skipped"] >= 1  # then routed around
        fresh, _ = start_peer(lookup, 1.0, "5:32")  # a peer is back
        assert retrieve(engine, 5, DOC) == DOC
        after = scrape(engine, "PeerBackend")
        assert after["bytes_read"] - during["bytes_read"] == 4 * CHUNK_BYTES
        report("peer", {"before": before, "during": during, "after": after}, "bytes_read")
    finally:
        for p in (proc, fresh):
            if p is not None:
                p.kill()
                p.wait()
        engine.close()
