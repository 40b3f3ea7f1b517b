"""Seed 004's adapter names (`lmcache.integration.vllm.vllm_adapter`, an alias of
`lmcache.compat.vllm_adapter`) on vLLM v1's terms: the engine `init_lmcache_engine` builds stores a
planned request's KV from vLLM-CPU's paged caches and loads it back into other blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from lmcache.cache_engine import LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.vllm.metadata import LMCacheConnectorMetadata, RequestPlan
from lmcache.integration.vllm.utils import ENGINE_NAME
from lmcache.integration.vllm.vllm_adapter import (
    RetrieveStatus,
    StoreStatus,
    init_lmcache_engine,
    lmcache_retrieve_kv,
    lmcache_should_retrieve,
    lmcache_should_store,
    lmcache_store_kv,
)

LAYERS, HEADS, HEAD_SIZE, BLOCK, BLOCKS = 2, 2, 64, 16, 8


def vllm_configs():
    model = SimpleNamespace(model="seed-adapter-test", dtype=torch.bfloat16,
                            get_num_layers=lambda parallel: LAYERS, get_num_kv_heads=lambda parallel: HEADS,
                            get_head_size=lambda: HEAD_SIZE)
    return model, SimpleNamespace(world_size=1), SimpleNamespace(block_size=BLOCK)


def caches(fill: bool) -> list[torch.Tensor]:
    """vLLM-CPU's per-layer caches ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``."""
    shape = (BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)
    return [torch.randn(shape).to(torch.bfloat16) if fill else torch.zeros(shape, dtype=torch.bfloat16)
            for _ in range(LAYERS)]


@pytest.fixture
def engine():
    config = LMCacheEngineConfig.from_defaults(chunk_size=BLOCK, max_local_cpu_size=0.01)
    engine = init_lmcache_engine(*vllm_configs(), config=config)
    yield engine
    LMCacheEngineBuilder.destroy(ENGINE_NAME)


def test_init_lmcache_engine_builds_one_engine_per_process(engine):
    assert init_lmcache_engine(*vllm_configs()) is engine
    assert engine.metadata.kv_shape == (LAYERS, 2, BLOCK, HEADS, HEAD_SIZE)


def test_store_then_retrieve_moves_whole_blocks_between_requests(engine):
    model, parallel, cache = vllm_configs()
    tokens = list(range(3 * BLOCK))
    src, dst = caches(fill=True), caches(fill=False)
    save = LMCacheConnectorMetadata([RequestPlan("a", tokens, [[1, 2, 3]], save_to=len(tokens))])
    assert lmcache_should_store(save) == [StoreStatus.PREFILL]
    lmcache_store_kv(model, parallel, cache, None, save, src, lmcache_should_store(save))

    load = LMCacheConnectorMetadata([RequestPlan("b", tokens, [[5, 6, 7]], load_to=len(tokens) - 1,
                                                 retrieve_to=len(tokens))])
    assert lmcache_should_retrieve(load) == [RetrieveStatus.PREFILL]
    out, bypass, hidden = lmcache_retrieve_kv(None, load, cache, dst, lmcache_should_retrieve(load))
    assert out is load and bypass is False and hidden is None
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[5:7], s[1:3])  # the two whole blocks before the last token


def test_nothing_planned_moves_nothing(engine):
    model, parallel, cache = vllm_configs()
    idle = LMCacheConnectorMetadata([RequestPlan("c", [1, 2, 3], [[1]])])
    assert lmcache_should_store(idle) == [StoreStatus.NONE]
    assert lmcache_should_retrieve(idle) == [RetrieveStatus.NONE]
    lmcache_store_kv(model, parallel, cache, None, idle, caches(fill=True), lmcache_should_store(idle))
    assert engine.lookup(torch.tensor([1, 2, 3])) == 0
