"""Code written for upstream's experimental API: its legacy backend names build real tiers, and a
prefetch after a lookup loads every chunk the lookup counted, also while its write is in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.memory_management import MixedMemoryAllocator
from lmcache.storage_backend import disk_file
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.token_database import ChunkedTokenDatabase
from tests.helpers.paged_kv import PagedKV, build_engine
from tests.integration.tiers.test_engine_tiers import flush, retrieve_equal, store

pytestmark = pytest.mark.integration
TIER_OF_WORD = {"cpu": "Hot", "disk": "LocalDiskBackend", "remote": "RemoteBackend"}
ONLY = {"LocalDiskBackend": "local_disk", "RemoteBackend": "remote"}  # a name with that tier alone


def engine_for(config: LMCacheEngineConfig) -> LMCacheEngine:
    metadata = LMCacheEngineMetadata("test-model", 1, 0, "vllm", torch.bfloat16, (2, 2, 8, 2, 4))
    return LMCacheEngine(config, metadata, MixedMemoryAllocator(1 << 20),
                         ChunkedTokenDatabase(config, metadata), VLLMPagedMemGPUConnectorV2(8, 2))


@pytest.mark.parametrize("name", ["cpu", "local_disk", "local_cpu_disk", "remote", "local_cpu_remote",
                                  "local_disk_remote", "local_cpu_disk_remote"])
def test_each_legacy_backend_name_builds_its_tiers_and_round_trips_through_each(name, tmp_path, valkey):
    def legacy(backend: str) -> LMCacheEngineConfig:
        url = f"redis://127.0.0.1:{valkey.port}" if "remote" in backend else None
        return LMCacheEngineConfig.from_legacy(chunk_size=8, backend=backend, remote_url=url,
                                               local_disk=str(tmp_path / "disk"))

    tiers = [tier for word, tier in TIER_OF_WORD.items() if word in name]
    engine = engine_for(legacy(name))
    assert list(engine.storage_manager.backends) == tiers
    kv, tokens, slots = store(engine)
    for tier in tiers:
        assert engine.lookup(tokens, tier) == 40
    assert retrieve_equal(engine, kv, tokens, slots) == 40
    engine.close()
    for tier in tiers:  # a fresh engine with that tier alone reads what this one stored there
        if tier in ONLY:
            alone = engine_for(legacy(ONLY[tier]))
            assert list(alone.storage_manager.backends) == [tier]
            assert retrieve_equal(alone, kv, tokens, slots) == 40
            alone.close()


@pytest.fixture
def slow_disk(monkeypatch):
    """Disk writes wait for `gate`; `reads` counts chunk reads from disk files."""

    class Probe:
        gate = threading.Event()
        reads = 0

    write, read = disk_file.write_atomic, LocalDiskBackend.load_bytes_from_disk

    def slow_write(*args, **kwargs):
        assert Probe.gate.wait(30), "test never opened the gate"
        write(*args, **kwargs)

    def counted_read(self, key):
        Probe.reads += 1
        return read(self, key)

    monkeypatch.setattr(disk_file, "write_atomic", slow_write)
    monkeypatch.setattr(LocalDiskBackend, "load_bytes_from_disk", counted_read)
    yield Probe
    Probe.gate.set()


def wait_hot(engine, keys, timeout=5.0) -> bool:
    """Whether every key is hot and its load done within `timeout` (a load promotes its chunk
    before it is marked done: a prefetch in between finds it still loading and skips it)."""
    manager = engine.storage_manager
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with manager._lock:
            loading = bool(manager._loading)
        if not loading and all(manager.hot.contains(k) for k in keys):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("via", ["prefetch", "lease"])
def test_prefetch_after_lookup_loads_every_counted_chunk(via, tmp_path, slow_disk):
    engine = build_engine(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01)
    torch.manual_seed(0)
    kv = PagedKV()
    tokens = torch.randint(0, 30000, (40,))
    slots = kv.slots_for(40)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)  # disk writes now wait at the gate
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
    hot = engine.storage_manager.hot

    def lookup_then_prefetch() -> int:
        for key in keys:
            hot.remove(key)  # evicted from the hot tier
        if via == "lease":
            return engine.lookup(tokens, lease_id="req-1")  # a lease starts the loads itself
        hit = engine.lookup(tokens)
        engine.prefetch(tokens)
        return hit

    assert lookup_then_prefetch() == 40  # every write is still in flight
    assert wait_hot(engine, keys), "the prefetch skipped chunks whose write is in flight"
    assert slow_disk.reads == 0  # they came from the objects being written
    engine.release("req-1")
    slow_disk.gate.set()
    flush(engine)
    assert lookup_then_prefetch() == 40  # now every chunk is only on disk
    assert wait_hot(engine, keys)
    assert slow_disk.reads == len(keys)  # one read per chunk
    assert retrieve_equal(engine, kv, tokens, slots) == 40 and slow_disk.reads == len(keys)
    engine.close()


def test_retrieve_without_a_hot_tier_uses_the_objects_being_written(tmp_path, slow_disk):
    config = LMCacheEngineConfig.from_legacy(chunk_size=8, backend="local_disk", local_disk=str(tmp_path))
    engine = engine_for(config)
    torch.manual_seed(1)
    kv = PagedKV()
    tokens = torch.randint(0, 30000, (40,))
    slots = kv.slots_for(40)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    assert engine.lookup(tokens) == 40
    assert retrieve_equal(engine, kv, tokens, slots) == 40 and slow_disk.reads == 0
    slow_disk.gate.set()
    flush(engine)
    assert retrieve_equal(engine, kv, tokens, slots) == 40 and slow_disk.reads == 5
    engine.close()
