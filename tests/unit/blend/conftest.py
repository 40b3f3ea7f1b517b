"""Fixtures for the CacheBlend unit tests: a real cache engine over small random KV, and the real
rotary functions of HF Llama on a tiny config (no weights)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lmcache.blend.interfaces import PositionalEncoder
from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import VLLMNestedTupleGPUConnector
from lmcache.integration.transformers.rope import make_encoders

NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, CHUNK = 3, 2, 8, 16
HIDDEN = NUM_KV_HEADS * HEAD_SIZE


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Iterator[LMCacheEngine]:
    """A real engine (hot CPU tier, 16-token chunks) for [T, 16]-per-layer KV of 3 layers."""
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01)
    metadata = LMCacheEngineMetadata("tiny", 1, 0, "vllm", torch.float32,
                                     (NUM_LAYERS, 2, CHUNK, NUM_KV_HEADS, HEAD_SIZE))
    instance = f"blend-unit-{request.node.name}"
    eng = LMCacheEngineBuilder.get_or_create(instance, config, metadata,
                                             VLLMNestedTupleGPUConnector(HIDDEN, NUM_LAYERS))
    yield eng
    LMCacheEngineBuilder.destroy(instance)


def random_kv(num_tokens: int, seed: int) -> torch.Tensor:
    """``[2, L, T, hidden]`` random KV."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, NUM_LAYERS, num_tokens, HIDDEN, generator=g)


def store_kv(engine: LMCacheEngine, tokens: torch.Tensor, kv: torch.Tensor) -> None:
    engine.store(tokens, kvcaches=[(kv[0, layer], kv[1, layer]) for layer in range(NUM_LAYERS)])


@pytest.fixture(scope="session")
def rope() -> tuple[PositionalEncoder, PositionalEncoder]:
    """(encode, reverse) over HF Llama's real rotary embedding (head size 8, theta 10000)."""
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_SIZE,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return make_encoders(LlamaRotaryEmbedding(cfg), HEAD_SIZE, apply_rotary_pos_emb)
