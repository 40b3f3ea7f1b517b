"""The request-level data path against real stores: one batched round trip per tier per retrieve
and per lookup, puts without EXISTS, a retrieve racing a prefetch reads each key once, and a
lookup lease pins what it counted in whichever tier."""

from __future__ import annotations

import time
from collections import Counter
from functools import wraps

import pytest
import redis
import torch

from lmcache.server.client import LMCacheClient
from tests.helpers.paged_kv import PagedKV, build_engine
from tests.helpers.servers import LatencyProxy
from tests.integration.tiers.test_engine_tiers import flush, retrieve_equal

pytestmark = pytest.mark.integration
CHUNK, N_CHUNKS = 8, 12
N_TOKENS = CHUNK * N_CHUNKS


class ServerCounts:
    """Requests the real server has served, by command (Valkey's INFO commandstats, the lm://
    server's HEALTH)."""

    def __init__(self, kind: str, port: int) -> None:
        self.kind, self.port = kind, port

    def __call__(self) -> Counter[str]:
        if self.kind == "valkey":
            r = redis.Redis(port=self.port)
            stats = r.info("commandstats")
            r.close()
            return Counter({name.removeprefix("cmdstat_").upper(): v["calls"] for name, v in stats.items()})
        c = LMCacheClient("127.0.0.1", self.port)
        ops = c.health()["ops"]
        c.close()
        return Counter({name: n for name, n in ops.items() if name != "HEALTH"})


@pytest.fixture(params=["valkey", "lm"])
def store(request, tmp_path, lm_server):
    """(scheme, port, ServerCounts) of a real remote store."""
    if request.param == "valkey":
        v = request.getfixturevalue("valkey")
        yield "redis", v.port, ServerCounts("valkey", v.port)
    else:
        s = lm_server()
        yield "lm", s.port, ServerCounts("lm", s.port)


def spy_calls(connector) -> Counter[str]:
    """Count the connector's calls (each is one request or one pipelined round trip)."""
    calls: Counter[str] = Counter()
    for name in ("get", "get_into", "get_many", "get_many_into", "exists", "exists_many", "put", "delete"):
        real = getattr(connector, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(connector, name, wraps(real)(counted))
    return calls


def stored(engine, seed=0):
    torch.manual_seed(seed)
    kv = PagedKV(num_blocks=64)
    tokens = torch.randint(0, 30000, (N_TOKENS,))
    slots = kv.slots_for(N_TOKENS)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    flush(engine)
    return kv, tokens, slots


def test_remote_puts_send_no_exists_and_reads_are_one_round_trip(store):
    scheme, port, counts = store
    engine = build_engine(CHUNK, remote_url=f"{scheme}://127.0.0.1:{port}")
    before = counts()
    kv, tokens, slots = stored(engine)
    after_store = counts() - before
    assert after_store["EXISTS"] == 0 and after_store[("SET" if scheme == "redis" else "PUT")] == N_CHUNKS

    engine.storage_manager.hot.clear()
    calls = spy_calls(engine.storage_manager.backends["RemoteBackend"].connector)
    before = counts()
    assert engine.lookup(tokens) == N_TOKENS
    assert dict(calls) == {"exists_many": 1}
    assert retrieve_equal(engine, kv, tokens, slots) == N_TOKENS
    assert dict(calls) == {"exists_many": 1, "get_many_into": 1}
    served = counts() - before
    assert served["EXISTS"] == N_CHUNKS and served["GET"] == N_CHUNKS  # each key once
    engine.close()


def test_a_retrieve_racing_a_prefetch_reads_each_key_once(store):
    scheme, port, counts = store
    proxy = LatencyProxy(port, rtt=0.3)  # the prefetch is still in flight when the retrieve starts
    engine = build_engine(CHUNK, remote_url=f"{scheme}://{proxy.url}", remote_timeout=10)
    kv, tokens, slots = stored(engine, seed=1)
    engine.storage_manager.hot.clear()
    before = counts()
    assert engine.lookup(tokens, lease_id="r") == N_TOKENS  # starts the prefetch
    assert retrieve_equal(engine, kv, tokens, slots) == N_TOKENS
    engine.release("r")
    assert (counts() - before)["GET"] == N_CHUNKS
    engine.close()
    proxy.close()


def pressure(engine, kv, rounds=6) -> None:
    """Store far more than the hot and disk tiers hold, so both must evict."""
    for _ in range(rounds):
        other = torch.randint(0, 30000, (4 * CHUNK,))
        engine.store(other, kvcaches=kv.layers, slot_mapping=kv.slots_for(4 * CHUNK))
        flush(engine)


def test_a_lease_keeps_disk_only_chunks_through_hot_and_disk_pressure(tmp_path):
    chunk_bytes = 2 * 2 * CHUNK * 8 * 2  # [2, L=2, 8 tokens, hidden 8] bf16
    file_bytes = chunk_bytes + 512  # payload plus file and blob headers (generous)
    engine = build_engine(CHUNK, cpu_bytes=6 * chunk_bytes, local_disk=str(tmp_path),
                          max_local_disk_size=8 * file_bytes / 2**30)
    torch.manual_seed(2)
    kv = PagedKV(num_blocks=256)
    leased = torch.randint(0, 30000, (4 * CHUNK,))
    slots = kv.slots_for(4 * CHUNK)
    engine.store(leased, kvcaches=kv.layers, slot_mapping=slots)
    flush(engine)
    engine.storage_manager.hot.clear()  # now on disk only
    assert engine.lookup(leased, lease_id="req") == 4 * CHUNK
    hot = engine.storage_manager.hot
    keys = [k for _, _, k in engine.token_database.process_tokens(leased)]
    deadline = time.monotonic() + 5
    while not all(hot.contains(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    pressure(engine, kv)
    disk = engine.storage_manager.backends["LocalDiskBackend"]
    assert hot.num_evicted > 0 and disk.num_evicted > 0
    assert all(hot.contains(k) for k in keys) and all(disk.contains(k) for k in keys)
    assert retrieve_equal(engine, kv, leased, slots) == 4 * CHUNK
    engine.release("req")
    pressure(engine, kv)
    assert engine.lookup(leased) == 0  # released: evicted like anything else
    engine.close()
