"""An `LMCacheEngine` for an HF transformers causal LM.

Keys are shareable with vLLM's canonical layout: `layout` "kv_blob", the model's name and weights
fingerprint as `lmcache.integration.checkpoint` derives them from the folder or hub id the model was
loaded from (the same functions the vLLM connector uses), world size 1, worker 0 and the KV dtype
(the model's dtype). So the same checkpoint, dtype and tokens give the same keys in both engines;
`fmt` ("huggingface") is not part of the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.integration.checkpoint import checkpoint_fingerprint
from lmcache.integration.checkpoint import model_name as checkpoint_name
from lmcache.integration.transformers.connector import HFKVConnector


@dataclass(frozen=True)
class KVGeometry:
    """Shape of a model's KV cache: per layer ``[1, num_kv_heads, T, head_size]``."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int

    @staticmethod
    def of(model: Any) -> KVGeometry:
        cfg = model.config.get_text_config(decoder=True)
        head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return KVGeometry(cfg.num_hidden_layers, cfg.num_attention_heads, num_kv, head_size)


def hf_engine_metadata(model: Any, config: LMCacheEngineConfig, *, model_name: str | None = None,
                       kv_dtype: torch.dtype | None = None) -> LMCacheEngineMetadata:
    """Metadata (and thus keys) for `model`'s KV; `model_name` defaults to its ``name_or_path``."""
    geo = KVGeometry.of(model)
    source = str(getattr(model, "name_or_path", "") or model.config.name_or_path)
    if not (model_name or source):
        raise ValueError("the model has no name_or_path; pass model_name=")
    return LMCacheEngineMetadata(
        model_name=model_name or checkpoint_name(source), world_size=1, worker_id=0, fmt="huggingface",
        kv_dtype=kv_dtype or model.dtype,
        kv_shape=(geo.num_layers, 2, config.chunk_size, geo.num_kv_heads, geo.head_size),
        layout="kv_blob", model_fingerprint=checkpoint_fingerprint(source) if source else "",
    )


def create_hf_engine(model: Any, config: LMCacheEngineConfig | None = None, *,
                     instance_id: str | None = None, model_name: str | None = None) -> LMCacheEngine:
    """The engine named `instance_id` (default ``"transformers:<model name>"``) from the process
    registry, built on first use with an `HFKVConnector`. `config` defaults to
    `LMCacheEngineConfig.load()` (file, then ``LMCACHE_*`` variables)."""
    config = config or LMCacheEngineConfig.load()
    metadata = hf_engine_metadata(model, config, model_name=model_name)
    geo = KVGeometry.of(model)
    connector = HFKVConnector(geo.num_layers, geo.num_kv_heads, geo.head_size)
    return LMCacheEngineBuilder.get_or_create(
        instance_id or f"transformers:{metadata.model_name}", config, metadata, connector)
