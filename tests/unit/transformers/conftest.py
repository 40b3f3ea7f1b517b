"""Fixtures for the transformers-integration unit tests: a tiny randomly initialised Llama (the real
HF implementation, 4 layers, GQA 4:2) and a real engine for it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.transformers import create_hf_engine

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024}


@pytest.fixture(scope="session")
def tiny_llama() -> Any:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    model.config.name_or_path = "tiny-llama-test"
    return model


@pytest.fixture
def tiny_engine(tiny_llama: Any, request: pytest.FixtureRequest) -> Iterator[LMCacheEngine]:
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01, enable_blending=True,
                                               blend_min_tokens=8)
    instance = f"tiny-{request.node.name}"
    yield create_hf_engine(tiny_llama, config, instance_id=instance)
    LMCacheEngineBuilder.destroy(instance)
