"""Sealed tiers against real stores (Valkey, the lm:// server): the store only ever holds sealed
bytes, a value moved under another key or sealed with another engine's key is a counted, deleted
miss, and tenants (different `cache_salt`s, i.e. `extra_key`s) never share a chunk in any tier."""

from __future__ import annotations

import os
import time

import pytest
import redis
import torch

from lmcache.config import LMCacheEngineConfig
from lmcache.memory_management import MixedMemoryAllocator
from lmcache.server.client import LMCacheClient
from lmcache.storage_backend.remote_backend import SEALED_READ_STREAMS, RemoteBackend
from lmcache.storage_backend.serde.seal import OVERHEAD
from tests.helpers import WRITE_WAIT
from tests.helpers.paged_kv import PagedKV, build_engine

from .test_remote_tiers import META, Tier, data, key

pytestmark = pytest.mark.integration
K1, K2 = (bytes([i]) * 32 for i in (1, 2))
CHUNK = 8


def key_file(tmp_path, name: str, *keys: bytes) -> str:
    path = tmp_path / name
    path.write_text("".join(k.hex() + "\n" for k in keys))
    return str(path)


class RawStore:
    """Direct access to the values of a Valkey or lm:// store, bypassing the tier."""

    def __init__(self, url: str) -> None:
        host, port = url.split("://")[1].split(":")
        self.lm = LMCacheClient(host, int(port)) if url.startswith("lm://") else None
        self.redis = None if self.lm else redis.Redis(host=host, port=int(port))

    def get(self, k: str) -> bytes | None:
        value = self.lm.get(k) if self.lm else self.redis.get(k)
        return None if value is None else bytes(value)

    def put(self, k: str, value: bytes) -> None:
        if self.lm:
            self.lm.put(k, [value])
        else:
            self.redis.set(k, value)

    def close(self) -> None:
        if self.lm:
            self.lm.close()
        else:
            self.redis.close()


@pytest.fixture(params=["valkey", "lm"])
def store(request):
    url = request.getfixturevalue("valkey").url if request.param == "valkey" else \
        request.getfixturevalue("lm_server")().url
    raw = RawStore(url)
    yield url, raw
    raw.close()


class SealedTier(Tier):
    """A `Tier` whose backend seals with the keys in `key_path` (None: no sealing)."""

    def __init__(self, url: str, key_path: str | None, serde: str = "naive") -> None:
        self.alloc = MixedMemoryAllocator(4 << 20)
        config = LMCacheEngineConfig.from_defaults(remote_url=url, remote_serde=serde,
                                                   kv_encryption_key=key_path)
        self.backend = RemoteBackend(config, META, self.alloc.allocate)


@pytest.fixture
def tier():
    made: list[SealedTier] = []

    def make(url: str, key_path: str | None, serde: str = "naive") -> SealedTier:
        made.append(SealedTier(url, key_path, serde))
        return made[-1]

    yield make
    for t in made:
        t.close()


def test_the_store_holds_only_sealed_values_and_they_read_back(store, tier, tmp_path):
    url, raw = store
    tier(url, None).put(1)
    plain = raw.get(key(1).to_string())
    sealed = tier(url, key_file(tmp_path, "k", K1))
    sealed.put(2)
    value = raw.get(key(2).to_string())
    assert value[:4] == b"LMCS" and len(value) == len(plain) + OVERHEAD
    assert data(2).view(torch.uint8).numpy().tobytes()[:64] not in value
    assert sealed.hit(2)
    assert not sealed.hit(1)  # the unsealed value: forged where sealing is on, and deleted
    assert sealed.backend.stats().counters["forged"] == 1 and raw.get(key(1).to_string()) is None


def test_a_sealed_batch_is_read_over_two_connections_at_once_and_reads_back_exactly(store, tier, tmp_path):
    """Sealed values are opened on the reading thread: a batched get splits its keys over
    `SEALED_READ_STREAMS` connections (one read on a tier thread), unsealed ones over one."""
    url, _ = store
    sealed, plain = tier(url, key_file(tmp_path, "k", K1)), tier(url + "?namespace=plain", None)
    ids = range(5)
    for t in (sealed, plain):
        t.put(*ids)
        calls: list[list[str]] = []
        get_many_into = t.backend.connector.get_many_into

        def spy(keys, read, calls=calls, get_many_into=get_many_into):
            calls.append(list(keys))
            return get_many_into(keys, read)

        t.backend.connector.get_many_into = spy
        got = t.backend.batched_get([key(i) for i in ids])
        assert all(torch.equal(obj.tensor, data(i)) for i, obj in zip(ids, got, strict=True))
        for obj in got:
            obj.ref_count_down()
        expected = SEALED_READ_STREAMS if t is sealed else 1
        assert len(calls) == expected and sorted(k for c in calls for k in c) == \
            sorted(t.backend._remote_key(key(i)) for i in ids)


def test_a_value_copied_under_another_key_is_a_counted_deleted_miss(store, tier, tmp_path):
    url, raw = store
    t = tier(url, key_file(tmp_path, "k", K1))
    t.put(1, 2)
    raw.put(key(2).to_string(), raw.get(key(1).to_string()))  # key 1's sealed value under key 2
    got = t.backend.batched_get([key(1), key(2)])
    assert got[0] is not None and got[1] is None
    got[0].ref_count_down()
    assert t.backend.stats().counters["forged"] == 1 and raw.get(key(2).to_string()) is None


def test_cachegen_streams_are_sealed_after_encoding_and_a_batch_decodes_them(valkey, tier, tmp_path):
    t = tier(valkey.url, key_file(tmp_path, "k", K1), serde="cachegen")
    t.put(0, 1, 2)
    r = redis.Redis(port=valkey.port)
    assert all(r.get(key(i).to_string())[:4] == b"LMCS" for i in range(3))
    r.set(key(2).to_string(), r.get(key(1).to_string()))  # moved
    batch = t.backend.batched_get([key(i) for i in range(3)])
    assert batch[2] is None and t.backend.stats().counters["forged"] == 1
    for i in (0, 1):
        assert float((batch[i].tensor.float() - data(i).float()).abs().max()) < 1.0  # lossy codec
        batch[i].ref_count_down()
    assert t.alloc.used_bytes == 0


def test_two_engines_with_different_keys_on_one_valkey_miss_each_others_values(valkey, tier, tmp_path):
    a = tier(valkey.url, key_file(tmp_path, "a", K1))
    b = tier(valkey.url, key_file(tmp_path, "b", K2))
    a.put(1)
    b.put(2)
    assert not b.hit(1) and not a.hit(2)
    assert a.backend.stats().counters["forged"] == 1 and b.backend.stats().counters["forged"] == 1
    a.put(1)
    assert a.hit(1)  # its own value still opens


# ---- tenants -----------------------------------------------------------------------------------

def engine(tmp_path, valkey, key_path: str):
    """An engine with every tier: hot, disk, the remote store and peers (found through the same
    Valkey)."""
    return build_engine(CHUNK, cpu_bytes=1 << 20, local_disk=str(tmp_path / "disk"),
                        max_local_disk_size=0.01, remote_url=valkey.url, kv_encryption_key=key_path,
                        enable_p2p=True, lookup_url=valkey.url, distributed_url="127.0.0.1:0", p2p_ttl=30.0)


def test_tenants_with_different_salts_share_no_chunk_and_miss_each_other_in_every_tier(tmp_path, valkey):
    path = key_file(tmp_path, "k", K1)
    owner = engine(tmp_path, valkey, path)
    kv = PagedKV()
    tokens = torch.randint(0, 30000, (4 * CHUNK,), generator=torch.Generator().manual_seed(3))
    slots = kv.slots_for(len(tokens))
    owner.store(tokens, kvcaches=kv.layers, slot_mapping=slots, extra_key="tenant-a")
    for name in ("LocalDiskBackend", "RemoteBackend"):
        assert owner.storage_manager.backends[name].puts.flush(WRITE_WAIT)
    tiers = ["LocalCPUBackend", "LocalDiskBackend", "RemoteBackend"]
    for tier in tiers:
        assert owner.lookup(tokens, search_range=[tier], extra_key="tenant-a") == len(tokens)
        assert owner.lookup(tokens, search_range=[tier], extra_key="tenant-b") == 0
        assert owner.lookup(tokens, search_range=[tier]) == 0  # no salt is a tenant of its own
    keys_a = {c[2].to_string() for c in owner.token_database.process_tokens(tokens, extra_key="tenant-a")}
    keys_b = {c[2].to_string() for c in owner.token_database.process_tokens(tokens, extra_key="tenant-b")}
    assert not keys_a & keys_b
    stored = {k.decode() for k in redis.Redis(port=valkey.port).keys("*")}
    assert keys_a <= stored and not keys_b & stored
    other = engine(tmp_path, valkey, path)  # a second engine: its hot tier is empty
    deadline = time.monotonic() + 10  # the owner's chunks reach the peer lookup service
    while other.lookup(tokens, search_range=["PeerBackend"], extra_key="tenant-a") < len(tokens):
        assert time.monotonic() < deadline, "the owner's chunks never became visible to its peer"
        time.sleep(0.05)
    assert other.lookup(tokens, search_range=["PeerBackend"], extra_key="tenant-b") == 0
    assert other.lookup(tokens, search_range=["PeerBackend"]) == 0
    target = kv.empty_like()
    got = other.retrieve(tokens, kvcaches=target.layers, slot_mapping=slots, extra_key="tenant-b")
    assert int(got.sum()) == 0
    got = other.retrieve(tokens, kvcaches=target.layers, slot_mapping=slots, extra_key="tenant-a")
    assert int(got.sum()) == len(tokens) and torch.equal(target.tokens_kv(slots), kv.tokens_kv(slots))
    for e in (owner, other):
        stats = e.storage_manager.stats()
        assert all(stats[t].counters.get("forged", 0) == 0 for t in ("LocalDiskBackend", "RemoteBackend"))
        e.close()
    assert os.listdir(tmp_path / "disk")
