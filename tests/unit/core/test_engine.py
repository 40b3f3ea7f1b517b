import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.cache_engine import LMCacheEngineBuilder
from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from tests.helpers.paged_kv import PagedKV, build_engine


def store_retrieve(engine, kv, tokens, slots, mask=None):
    engine.store(tokens, mask, kvcaches=kv.layers, slot_mapping=slots)
    out = kv.empty_like()
    ret = engine.retrieve(tokens, mask, kvcaches=out.layers, slot_mapping=slots)
    return out, ret


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_tokens=st.integers(1, 60),
    chunk_size=st.sampled_from([4, 8, 16]),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    data=st.data(),
)
def test_store_then_retrieve_returns_bit_identical_kv(n_tokens, chunk_size, layers, heads, dtype, data):
    engine = build_engine(chunk_size, layers, heads, 4, dtype)
    kv = PagedKV(layers, heads, 4, 4, 64, dtype)
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, 30000), min_size=n_tokens, max_size=n_tokens)))
    slots = kv.slots_for(n_tokens)
    n_false = data.draw(st.integers(0, (n_tokens - 1) // chunk_size)) * chunk_size
    mask = torch.arange(n_tokens) >= n_false if n_false else None
    out, ret = store_retrieve(engine, kv, tokens, slots, mask)
    expected = torch.arange(n_tokens) >= n_false
    assert torch.equal(ret, expected) and ret.device.type == "cpu"
    assert torch.equal(out.tokens_kv(slots[n_false:]), kv.tokens_kv(slots[n_false:]))
    assert torch.equal(out.tokens_kv(slots[:n_false]), torch.zeros_like(kv.tokens_kv(slots[:n_false])))
    engine.close()


@settings(max_examples=20, deadline=None)
@given(stored=st.integers(1, 40), extra=st.integers(1, 40), diverge=st.booleans())
def test_partial_prefix_hit_returns_exactly_the_cached_prefix(stored, extra, diverge):
    chunk = 8
    engine = build_engine(chunk)
    kv = PagedKV()
    tokens = torch.randint(0, 30000, (stored + extra,))
    slots = kv.slots_for(stored + extra)
    engine.store(tokens[:stored], kvcaches=kv.layers, slot_mapping=slots[:stored])
    query = tokens.clone()
    if diverge:
        query[stored // 2] += 1  # change one token inside the stored part
    hit_expected = (stored // chunk) * chunk  # full chunks only: the partial chunk differs
    if diverge:
        hit_expected = min(hit_expected, (stored // 2 // chunk) * chunk)
    out = kv.empty_like()
    assert engine.lookup(query) == hit_expected
    ret = engine.retrieve(query, kvcaches=out.layers, slot_mapping=slots)
    assert int(ret.sum()) == hit_expected and bool(ret[:hit_expected].all())
    assert torch.equal(out.tokens_kv(slots[:hit_expected]), kv.tokens_kv(slots[:hit_expected]))
    engine.close()


def test_exact_repeat_hits_the_trailing_partial_chunk(engine):
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (21,))
    slots = kv.slots_for(21)
    out, ret = store_retrieve(engine, kv, tokens, slots)
    assert bool(ret.all()) and engine.lookup(tokens) == 21
    assert torch.equal(out.tokens_kv(slots), kv.tokens_kv(slots))


def test_store_skips_chunks_already_cached(engine):
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (32,))
    slots = kv.slots_for(32)
    engine.store(tokens[:16], kvcaches=kv.layers, slot_mapping=slots)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    assert engine.stats.get("store_skipped_tokens") == 16 and engine.stats.get("stored_tokens") == 32


def test_lookup_search_range(engine):
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    assert engine.lookup(tokens, ["Hot"]) == 16
    assert engine.lookup(tokens, ["LocalDiskBackend"]) == 0
    assert engine.lookup(tokens, []) == 0
    with pytest.raises(ValueError, match="Hott"):
        engine.lookup(tokens, ["Hott"])


def test_lookup_takes_one_name_as_a_string_and_the_hot_tier_alias(engine):
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    assert engine.lookup(tokens, "Hot") == 16
    assert engine.lookup(tokens, "LocalCPUBackend") == 16
    assert engine.lookup(tokens, ["LocalCPUBackend", "RemoteBackend"]) == 16
    assert engine.lookup(tokens, "LocalDiskBackend") == 0 and engine.lookup(tokens, "RemoteBackend") == 0
    with pytest.raises(ValueError, match="LocalCPUBackend") as err:
        engine.lookup(tokens, "LocalGPUBackend")
    assert "'H'" not in str(err.value)


@pytest.mark.parametrize("worker_id, world_size", [(123, 3), (-1, 1)])
def test_metadata_with_an_out_of_range_worker_stores_and_retrieves(worker_id, world_size):
    config = LMCacheEngineConfig.from_defaults(chunk_size=8, max_local_cpu_size=(1 << 20) / (1 << 30))
    metadata = LMCacheEngineMetadata("test-model", world_size, worker_id, "vllm", torch.bfloat16,
                                     (2, 2, 8, 2, 4))
    engine = LMCacheEngineBuilder.get_or_create("odd-worker", config, metadata,
                                                VLLMPagedMemGPUConnectorV2(8, 2))
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (20,))
    slots = kv.slots_for(20)
    out, ret = store_retrieve(engine, kv, tokens, slots)
    assert bool(ret.all()) and torch.equal(out.tokens_kv(slots), kv.tokens_kv(slots))
    key = engine.token_database.process_tokens(tokens)[0][2]
    assert key.worker_id == worker_id and CacheEngineKey.from_string(key.to_string()) == key


def test_retrieve_with_bad_mask_raises(engine):
    kv = PagedKV()
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        engine.retrieve(torch.arange(16), torch.arange(16) >= 3, kvcaches=kv.layers,
                        slot_mapping=kv.slots_for(16))
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        engine.store(torch.arange(16), torch.arange(16) >= 3, kvcaches=kv.layers,
                     slot_mapping=kv.slots_for(16))


def test_full_arena_stores_fewer_chunks_and_never_crashes(caplog):
    chunk_bytes = 2 * 2 * 8 * 8 * 2  # [2, L=2, 8 tokens, hidden 8] bf16 = 512 bytes
    engine = build_engine(8, cpu_bytes=3 * chunk_bytes)
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (40,))
    slots = kv.slots_for(40)
    held = []
    engine.store(tokens[:24], kvcaches=kv.layers, slot_mapping=slots)  # fills the arena
    for _, _, key in engine.token_database.process_tokens(tokens[:24]):
        held += engine.storage_manager.get_prefix([key])  # readers hold every chunk
    other = torch.randint(0, 1000, (16,))

    def arena_lines(level: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if "CPU arena full" in r.getMessage()
                and r.levelname == level]

    with caplog.at_level("INFO", logger="lmcache.cache_engine"):
        for _ in range(3):  # capacity, not a failure: counted, summarized once per interval
            engine.store(other, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
        assert engine.lookup(other) == 0 and engine.stats.get("store_dropped_tokens") == 48
        assert not arena_lines("WARNING") and len(arena_lines("INFO")) == 1
        for obj in held:
            obj.ref_count_down()
        engine.store(other, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))  # now evicts LRU
        assert engine.lookup(other) == 16
    engine.memory_allocator.check_integrity()
    engine.close()


def test_concurrent_store_and_retrieve_from_four_threads():
    engine = build_engine(8, cpu_bytes=64 * 1024)  # small: forces eviction under contention
    kv = PagedKV(num_blocks=256)
    prompts = [(torch.randint(0, 30000, (40,)), kv.slots_for(40)) for _ in range(8)]
    errors: list[BaseException] = []

    def worker(tid):
        try:
            for it in range(30):
                tokens, slots = prompts[(tid + it) % len(prompts)]
                engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
                out = kv.empty_like()
                ret = engine.retrieve(tokens, kvcaches=out.layers, slot_mapping=slots)
                n = int(ret.sum())
                assert bool(ret[:n].all())
                assert torch.equal(out.tokens_kv(slots[:n]), kv.tokens_kv(slots[:n]))
        except BaseException as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    engine.memory_allocator.check_integrity()
    engine.close()
    assert engine.memory_allocator.used_bytes == 0


class ExplodingConnector(VLLMPagedMemGPUConnectorV2):
    """Copies one chunk, reports the copy complete, then raises (breaking the on_done contract)."""

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
        super().batched_to_gpu(memory_objs[:1], starts[:1], ends[:1], **kwargs)
        raise RuntimeError("injected copy failure")


def test_error_handling_turns_unexpected_errors_into_misses():
    for on in (True, False):
        engine = build_engine(8, error_handling=on)
        engine.gpu_connector = ExplodingConnector(8, 2)
        kv = PagedKV()
        tokens = torch.randint(0, 1000, (24,))
        slots = kv.slots_for(24)
        engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
        if on:
            ret = engine.retrieve(tokens, kvcaches=kv.layers, slot_mapping=slots)
            assert int(ret.sum()) == 0 and engine.stats.get("errors") == 1
        else:
            with pytest.raises(RuntimeError, match="injected"):
                engine.retrieve(tokens, kvcaches=kv.layers, slot_mapping=slots)
        assert len(engine.storage_manager.hot) == 3
        engine.check_integrity()  # nothing in flight, every chunk released once: held by the tier alone
        engine.close()


def test_a_lower_tier_chunk_of_the_wrong_shape_ends_the_prefix_as_a_miss(tmp_path):
    """An intact blob that does not hold its chunk's KV (another layout, a stale or foreign
    writer) is a miss where it starts, not an error from deep inside the connector."""
    from lmcache.storage_backend.serde import keyed_blob
    from tests.helpers import WRITE_WAIT

    engine = build_engine(8, local_disk=str(tmp_path), max_local_disk_size=0.01)
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (24,))
    slots = kv.slots_for(24)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    disk = engine.storage_manager.backends["LocalDiskBackend"]
    assert disk.puts.flush(WRITE_WAIT)
    key = engine.token_database.process_tokens(tokens)[1].key
    misfit = torch.zeros(2, 2, 4, 8, dtype=torch.bfloat16)  # 4 tokens where the chunk has 8
    parts = keyed_blob.keyed_parts(key.to_string().encode(), disk.serializer.to_parts(misfit))
    with open(disk._key_to_path(key), "wb") as f:
        f.write(b"".join(bytes(p) for p in parts))
    engine.storage_manager.hot.clear()
    out = kv.empty_like()
    ret = engine.retrieve(tokens, kvcaches=out.layers, slot_mapping=slots)
    assert torch.equal(ret, torch.arange(24) < 8) and engine.stats.get("errors") == 0
    assert torch.equal(out.tokens_kv(slots[:8]), kv.tokens_kv(slots[:8]))
    assert torch.equal(out.tokens_kv(slots[8:]), torch.zeros_like(kv.tokens_kv(slots[8:])))
    engine.check_integrity()
    engine.close()


def test_prefetch_of_hot_chunks_is_harmless(engine):
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    engine.prefetch(tokens)
    engine.prefetch(torch.randint(0, 1000, (16,)))
    assert engine.lookup(tokens) == 16


def test_close_releases_all_memory(engine):
    kv = PagedKV()
    engine.store(torch.randint(0, 1000, (30,)), kvcaches=kv.layers, slot_mapping=kv.slots_for(30))
    assert engine.memory_allocator.used_bytes > 0
    engine.close()
    assert engine.memory_allocator.used_bytes == 0


def metadata(chunk=256):
    return LMCacheEngineMetadata(model_name="m", world_size=1, worker_id=0, fmt="vllm",
                                 kv_dtype=torch.bfloat16, kv_shape=(2, 2, chunk, 2, 4))


def test_builder_get_or_create_get_destroy():
    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=0.001)
    conn = VLLMPagedMemGPUConnectorV2(8, 2)
    e1 = LMCacheEngineBuilder.get_or_create("a", cfg, metadata(), conn)
    assert LMCacheEngineBuilder.get_or_create("a", cfg, metadata(), conn) is e1
    assert LMCacheEngineBuilder.get("a") is e1 and LMCacheEngineBuilder.get("b") is None
    other = LMCacheEngineConfig.from_defaults(max_local_cpu_size=0.002)
    with pytest.raises(ValueError, match="different configuration"):
        LMCacheEngineBuilder.get_or_create("a", other, metadata(), conn)
    LMCacheEngineBuilder.destroy("a")
    assert LMCacheEngineBuilder.get("a") is None
    LMCacheEngineBuilder.destroy("a")  # idempotent


def test_engine_start_up_errors_are_clear():
    conn = VLLMPagedMemGPUConnectorV2(8, 2)
    with pytest.raises(ValueError, match="chunk size"):
        small = LMCacheEngineConfig.from_defaults(chunk_size=128, max_local_cpu_size=0.001)
        LMCacheEngineBuilder.get_or_create("x", small, metadata(), conn)
    p2p = LMCacheEngineConfig.from_defaults(enable_p2p=True, lookup_url="h:1",  # 192.0.2.1: not ours
                                            distributed_url="192.0.2.1:0", max_local_cpu_size=0.001)
    with pytest.raises(ValueError, match=r"distributed_url '192\.0\.2\.1:0': cannot serve peers"):
        LMCacheEngineBuilder.get_or_create("y", p2p, metadata(), conn)
    with pytest.raises(ValueError, match="must be > 0"):
        LMCacheEngineBuilder.get_or_create("z", LMCacheEngineConfig.from_defaults(max_local_cpu_size=0),
                                           metadata(), conn)


def test_a_builder_whose_engine_fails_to_start_closes_the_arena_it_made(monkeypatch):
    """The builder makes the engine's allocator (a CPU arena, or a cache-server client with its
    heartbeat thread): an engine that fails to start must not leave it behind."""
    import lmcache.cache_engine as cache_engine

    closed = []
    make = cache_engine._make_allocator

    def tracked(config, metadata):
        allocator = make(config, metadata)
        close = allocator.close
        allocator.close = lambda: (closed.append(allocator), close())
        return allocator

    monkeypatch.setattr(cache_engine, "_make_allocator", tracked)
    small = LMCacheEngineConfig.from_defaults(chunk_size=128, max_local_cpu_size=0.001)
    with pytest.raises(ValueError, match="chunk size"):
        LMCacheEngineBuilder.get_or_create("x", small, metadata(), VLLMPagedMemGPUConnectorV2(8, 2))
    assert len(closed) >= 1 and LMCacheEngineBuilder.get("x") is None


def test_seed_module_paths_import():
    from lmcache.experimental.cache_engine import LMCacheEngine, LMCacheEngineBuilder
    from lmcache.experimental.config import LMCacheEngineConfig as C2
    from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2 as V2
    from lmcache.experimental.memory_management import MemoryFormat, TensorMemoryAllocator
    from lmcache.experimental.storage_backend.abstract_backend import StorageBackendInterface
    from lmcache.experimental.storage_backend.storage_manager import StorageManager
    from lmcache.experimental.token_database import ChunkedTokenDatabase, TokenDatabase

    assert C2 is LMCacheEngineConfig and V2 is VLLMPagedMemGPUConnectorV2
    assert TensorMemoryAllocator.ALIGN_BYTES == 512 and MemoryFormat.KV_BLOB.value == 1
    assert all([LMCacheEngine, LMCacheEngineBuilder, StorageBackendInterface, StorageManager,
                ChunkedTokenDatabase, TokenDatabase])


def test_lookup_lease_pins_counted_chunks_until_released():
    chunk_bytes = 2 * 2 * 8 * 8 * 2
    engine = build_engine(8, cpu_bytes=2 * chunk_bytes)
    kv = PagedKV()
    a, b = torch.randint(0, 1000, (16,)), torch.randint(0, 1000, (16,))
    engine.store(a, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    assert engine.lookup(a, lease_id="req-a") == 16
    engine.store(b, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))  # would evict a's chunks
    assert engine.lookup(b) == 0 and engine.lookup(a) == 16
    engine.release("req-a")
    engine.store(b, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    assert engine.lookup(b) == 16 and engine.lookup(a) == 0
    engine.close()


def test_leases_expire_and_repeated_acquire_replaces():
    from lmcache.cache_key import CacheEngineKey
    from lmcache.storage_backend.leases import LeaseTable, PinTable

    pins = PinTable()
    keys = [CacheEngineKey("kv_blob", "m", 1, 0, str(i), "uint8") for i in range(2)]
    now = [0.0]
    leases = LeaseTable(pins, clock=lambda: now[0])
    leases.acquire("r", keys, ttl=5)
    leases.acquire("r", keys, ttl=5)  # idempotent: pins are replaced, not stacked
    assert pins.pinned() == keys and [pins.count(k) for k in keys] == [1, 1]
    leases.acquire("s", keys[:1], ttl=50)
    assert [pins.count(k) for k in keys] == [2, 1]
    now[0] = 6.0
    leases.acquire("other", [], ttl=5)  # any call expires old leases
    assert pins.pinned() == keys[:1] and pins.count(keys[0]) == 1 and len(leases) == 2
    leases.release("s")
    assert len(pins) == 0


def test_a_repeated_acquire_keeps_the_leases_keys_pinned_throughout():
    """vLLM repeats a waiting request's lookup under the same lease id: its chunks must stay pinned
    while the lease's pins are replaced (an eviction in between would drop them)."""
    from lmcache.cache_key import CacheEngineKey
    from lmcache.storage_backend.leases import LeaseTable, PinTable

    pins = PinTable()
    keys = [CacheEngineKey("kv_blob", "m", 1, 0, str(i), "uint8") for i in range(2)]
    leases = LeaseTable(pins)
    leases.acquire("r", keys, ttl=5)
    seen = []
    unpin = pins.unpin

    def watched(released):
        unpin(released)
        seen.append([pins.is_pinned(k) for k in keys])  # what an eviction at this moment sees

    pins.unpin = watched  # type: ignore[method-assign]
    leases.acquire("r", keys, ttl=5)
    assert seen == [[True, True]] and [pins.count(k) for k in keys] == [1, 1]
