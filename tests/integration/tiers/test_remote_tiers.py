"""RemoteBackend against real stores: Valkey (plain, TLS via a proxy, sentinel, cluster) and the
lm:// server, including servers that die, hang and come back."""

from __future__ import annotations

import logging
import signal
import threading
import time

import pytest
import redis
import torch
from redis.crc import key_slot

from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import MemoryFormat, MixedMemoryAllocator, release_all
from lmcache.storage_backend.remote_backend import RemoteBackend
from tests.helpers import WRITE_WAIT

pytestmark = pytest.mark.integration
SHAPE = torch.Size([2, 2, 16, 8])
META = LMCacheEngineMetadata("test-model", 1, 0, "vllm", torch.bfloat16, (2, 2, 16, 2, 4))
MISS_WARNING = "treated as a cache miss"


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("kv_blob", "test-model", 1, 0, f"{i:032x}", "bfloat16")


def data(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


class Tier:
    """A RemoteBackend over an arena, with helpers to store and check chunks."""

    def __init__(self, url: str, serde: str = "naive", timeout: float = 2.0) -> None:
        self.alloc = MixedMemoryAllocator(4 << 20)
        config = LMCacheEngineConfig.from_defaults(remote_url=url, remote_serde=serde, remote_timeout=timeout)
        self.backend = RemoteBackend(config, META, self.alloc.allocate)

    def put(self, *ids: int) -> None:
        for i in ids:
            obj = self.alloc.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_BLOB)
            obj.tensor.copy_(data(i))
            self.backend.submit_put_task(key(i), obj)
            obj.ref_count_down()
        assert self.backend.puts.flush(WRITE_WAIT)

    def hit(self, i: int) -> bool:
        obj = self.backend.get_blocking(key(i))
        if obj is None:
            return False
        assert torch.equal(obj.tensor, data(i)), "a hit returned wrong KV"
        obj.ref_count_down()
        return True

    def close(self) -> None:
        self.backend.close()


@pytest.fixture
def tier():
    tiers: list[Tier] = []

    def make(url: str, **kw) -> Tier:
        t = Tier(url, **kw)
        tiers.append(t)
        return t

    yield make
    for t in tiers:
        t.close()


@pytest.fixture(params=["redis", "valkey", "rediss", "sentinel", "cluster", "lm"])
def store_url(request):
    kind = request.param
    if kind in ("redis", "valkey"):
        return request.getfixturevalue("valkey").url.replace("redis", kind)
    if kind == "rediss":
        return request.getfixturevalue("tls_valkey")[0]
    if kind == "sentinel":
        return request.getfixturevalue("sentinel")
    if kind == "cluster":
        nodes = request.getfixturevalue("cluster")
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    return request.getfixturevalue("lm_server")().url


def test_chunks_round_trip_through_every_scheme(store_url, tier):
    writer, reader = tier(store_url), tier(store_url)
    writer.put(*range(6))
    assert all(reader.backend.contains(key(i)) for i in range(6)) and not reader.backend.contains(key(99))
    assert all(reader.hit(i) for i in range(6)) and not reader.hit(99)
    batch = reader.backend.batched_get([key(i) for i in (0, 99, 5)])
    assert batch[1] is None
    assert torch.equal(batch[0].tensor, data(0)) and torch.equal(batch[2].tensor, data(5))


@pytest.mark.parametrize("serde", ["naive", "fast", "torch", "safe"])
def test_every_serde_round_trips_through_valkey(valkey, tier, serde):
    tier(valkey.url, serde=serde).put(1, 2)
    reader = tier(valkey.url, serde=serde)
    assert reader.hit(1) and reader.hit(2)
    assert not tier(valkey.url, serde="naive" if serde != "naive" else "torch").hit(1)  # foreign: a miss
    assert redis.Redis(port=valkey.port).dbsize() == 2  # ... and left alone


@pytest.mark.parametrize("serde", ["cachegen", "torch"])
def test_a_batch_of_a_decoding_serde_decodes_off_the_reading_thread(valkey, tier, serde):
    """Values of a serde that decodes are decoded on the tier's decode thread while the next ones
    arrive; the batch is what single gets give, in order, with misses and corrupt values."""
    tier(valkey.url, serde=serde).put(*range(5))
    r = redis.Redis(port=valkey.port)
    r.set(key(3).to_string(), r.get(key(3).to_string())[:-1])  # truncated: corrupt
    reader = tier(valkey.url, serde=serde)
    de = reader.backend.deserializer
    threads: list[str] = []
    decode = de.from_bytes_to

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return decode(*args, **kwargs)

    de.from_bytes_to = spy
    batch = reader.backend.batched_get([key(i) for i in (4, 99, 3, 0, 1, 2)])
    assert batch[1] is None and batch[2] is None  # a miss; a corrupt value: a miss, deleted
    assert r.exists(key(3).to_string()) == 0 and reader.backend.num_corrupt == 1
    assert len(threads) == 4 and all(t.startswith("lmcache-remote-decode") for t in threads)
    for i, obj in zip((4, 0, 1, 2), (batch[0], *batch[3:]), strict=True):
        single = reader.backend.get_blocking(key(i))
        assert torch.equal(obj.tensor, single.tensor)  # the same decode as a single get
        assert float((obj.tensor.float() - data(i).float()).abs().max()) < 1.0
        single.ref_count_down()
        obj.ref_count_down()
    assert reader.alloc.used_bytes == 0  # every buffer given back


def test_a_decode_that_fails_by_itself_raises_and_leaks_no_buffer(valkey, tier):
    """A decoder fault that is not a bad blob (a bug; no real store produces one) propagates out
    of the batch, and the values already decoded are given back."""
    tier(valkey.url, serde="cachegen").put(*range(4))
    reader = tier(valkey.url, serde="cachegen")
    de = reader.backend.deserializer
    decode, calls = de.from_bytes_to, []

    def failing_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("decoder bug")
        return decode(*args, **kwargs)

    de.from_bytes_to = failing_third
    with pytest.raises(RuntimeError, match="decoder bug"):
        reader.backend.batched_get([key(i) for i in range(4)])
    assert len(calls) == 4 and reader.alloc.used_bytes == 0
    de.from_bytes_to = decode
    batch = reader.backend.batched_get([key(i) for i in range(4)])  # the store is still fine
    assert all(obj is not None for obj in batch)
    release_all(batch)
    assert reader.alloc.used_bytes == 0


def test_namespace_and_ttl_options(valkey, tier):
    t = tier(valkey.url + "/3?namespace=teamA&ttl=100")
    t.put(1)
    r = redis.Redis(port=valkey.port, db=3)
    (k,) = r.keys("*")
    assert k.decode() == "teamA:" + key(1).to_string() and 0 < r.ttl(k) <= 100
    assert not tier(valkey.url + "/3").hit(1) and t.hit(1)


def test_corrupt_values_in_the_store_are_misses_and_get_deleted(valkey, tier):
    t = tier(valkey.url + "?backoff=5")  # were a bad value a fault of the store, key 4 would miss
    t.put(1, 2, 3, 4)
    r = redis.Redis(port=valkey.port)
    r.set(key(1).to_string(), b"not a blob")
    blob = r.get(key(2).to_string())
    r.set(key(2).to_string(), blob[:-1])
    overflowing = bytearray(r.get(key(3).to_string()))
    overflowing[8 + 7] ^= 0x80  # the header's first shape dim: >= 2**63
    r.set(key(3).to_string(), bytes(overflowing))
    assert not t.hit(1) and not t.hit(2) and not t.hit(3) and t.hit(4)
    assert r.keys() == [key(4).to_string().encode()] and t.backend.num_corrupt == 3
    assert t.backend.stats().counters["failures"] == 0
    t.put(1)
    assert t.hit(1)


def test_a_value_larger_than_the_lm_server_is_a_dropped_put_not_a_fault(lm_server, tier):
    t = tier(lm_server("--max-size-gb", str(2000 / (1 << 30))).url + "?backoff=5")  # room for one chunk
    t.put(1)
    big = t.alloc.allocate(torch.Size([2, 2, 64, 8]), torch.bfloat16, MemoryFormat.KV_BLOB)  # 4 KiB
    t.backend.submit_put_task(key(2), big)
    big.ref_count_down()
    assert t.backend.puts.flush(WRITE_WAIT)
    assert t.hit(1) and not t.hit(2)  # reads go on: the store is not backed off
    counters = t.backend.stats().counters
    assert (counters["too_large"], counters["puts_dropped"], counters["puts_written"]) == (1, 1, 1)
    assert (counters["failures"], counters["skipped"]) == (0, 0)


def test_killed_valkey_gives_misses_warned_once_and_hits_resume_when_it_is_back(durable_valkey, tier, caplog):
    t = tier(durable_valkey.url + "?backoff=0.1&max_backoff=0.2")
    t.put(*range(4))
    durable_valkey.kill()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            for i in range(4):
                assert not t.hit(i) and not t.backend.contains(key(i))
        t.put(10)  # a put while it is down is skipped, not raised
    assert sum(MISS_WARNING in r.message for r in caplog.records) == 1
    durable_valkey.start()  # same port, data from its append-only file
    deadline = time.monotonic() + 5
    while not t.hit(0):
        assert time.monotonic() < deadline, "hits did not resume"
        time.sleep(0.05)
    assert all(t.hit(i) for i in range(4)) and not t.hit(10)
    t.put(10)
    assert t.hit(10)


def test_a_hung_valkey_times_out_into_misses_and_recovers(valkey, tier):
    t = tier(valkey.url + "?backoff=0.1&max_backoff=0.1", timeout=0.3)
    t.put(1)
    valkey.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert not t.hit(1)
        assert time.monotonic() - t0 < 2  # bounded by remote_timeout, not hanging
        assert not t.hit(1)  # backing off: immediate
    finally:
        valkey.proc.send_signal(signal.SIGCONT)
    time.sleep(0.15)
    assert t.hit(1)


def test_tls_with_an_untrusted_certificate_is_a_miss_not_an_error(tls_valkey, tier):
    url, proxy = tls_valkey
    tier(url).put(1)
    untrusted = tier(f"rediss://127.0.0.1:{proxy.port}")
    assert not untrusted.hit(1) and not untrusted.backend.contains(key(1))
    assert tier(url).hit(1)


def test_a_dead_cluster_node_loses_only_its_share_of_the_keys(cluster, tier, caplog):
    url = "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in cluster) + "?backoff=0.2"
    t = tier(url)
    ids = list(range(30))
    t.put(*ids)
    per = 16384 // 3
    node_of = {i: min(key_slot(key(i).to_string().encode()) // per, 2) for i in ids}
    assert set(node_of.values()) == {0, 1, 2}  # the keys really are spread
    cluster[1].kill()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            hits = {i: t.hit(i) for i in ids}
    assert hits == {i: node_of[i] != 1 for i in ids}
    batch = t.backend.batched_get([key(i) for i in ids])
    assert [b is not None for b in batch] == [node_of[i] != 1 for i in ids]
    warnings = [r for r in caplog.records if MISS_WARNING in r.message]
    assert len(warnings) == 1 and str(cluster[1].port) in warnings[0].message
