"""What LMCache stores of each KV cache group vLLM gives the connector, or why it cannot serve a
model exactly.

vLLM splits a model's layers into KV cache groups (`KVCacheConfig.kv_cache_groups`): each group has
one spec and its own block table per request. `model_kv(vllm_config, kv_cache_config, chunk_size)`
reads them into a `ModelKV`, or raises `UnsupportedModel` with one message naming the model type
and what is missing; the connector then stays inactive and vLLM serves every request without it.

Group kinds (`GroupKind`):

- ``FULL``: full attention; K and V of every token are kept while the request runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class UnsupportedModel(ValueError):
    """The connector cannot serve this model exactly (the message says why)."""


class GroupKind(enum.Enum):
    FULL = "full"


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: `index` is its position in the per-group block-id tuples."""

    index: int
    kind: GroupKind
    block_size: int
    layers: tuple[str, ...]


@dataclass(frozen=True)
class ModelKV:
    """The KV cache groups of one model, as LMCache stores them. `token_layers`: the layers whose KV
    is stored per token, in chunk-row order (by layer index)."""

    model_type: str
    groups: tuple[KVGroup, ...]
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def token_layers(self) -> tuple[str, ...]:
        return tuple(sorted((n for g in self.groups for n in g.layers), key=layer_index))


def model_kv(vllm_config: Any, kv_cache_config: Any, chunk_size: int) -> ModelKV:
    """The groups of `kv_cache_config` as LMCache stores them; `UnsupportedModel` otherwise."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    model_type = _model_type(vllm_config)

    def refuse(missing: str) -> UnsupportedModel:
        return UnsupportedModel(f"LMCache cannot serve {model_type} models exactly: {missing}. The "
                                "connector is inactive for this engine; vLLM serves every request "
                                "without it.")

    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise refuse("vLLM gave the connector no KV cache configuration")
    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) is not FullAttentionSpec or spec.attention_chunk_size:
            raise refuse(f"KV cache group {i} is a {type(spec).__name__}, which the connector does "
                         "not store yet")
        if spec.block_size <= 0 or chunk_size % spec.block_size:
            raise refuse(f"lmcache.chunk_size={chunk_size} is not a multiple of vLLM's block size "
                         f"{spec.block_size}; set lmcache.chunk_size to a multiple of it")
        groups.append(KVGroup(i, GroupKind.FULL, spec.block_size, tuple(group.layer_names)))
    if len(groups) > 1:
        raise refuse(f"{len(groups)} KV cache groups (the connector handles one group today)")
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    if spec.kv_quant_mode != KVQuantMode.NONE or spec.head_size_v != spec.head_size:
        raise refuse(f"a quantized or asymmetric KV cache ({spec.kv_quant_mode.name}, K head size "
                     f"{spec.head_size}, V head size {spec.head_size_v})")
    return ModelKV(model_type, tuple(groups), spec.num_kv_heads, spec.head_size, spec.dtype)


def _model_type(vllm_config: Any) -> str:
    hf_config = getattr(vllm_config.model_config, "hf_config", None)
    return str(getattr(hf_config, "model_type", None) or "this model's")


def layer_index(name: str) -> tuple[int, str]:
    """Sort key of a layer name: its first number ("model.layers.12.attn" -> 12), then the name."""
    digits = ""
    for ch in name:
        if ch.isdigit():
            digits += ch
        elif digits:
            break
    return (int(digits) if digits else 0, name)
