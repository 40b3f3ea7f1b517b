"""This worker's engine for vLLM's KV caches: which layout vLLM keeps them in, the connector that
copies that layout, and the engine built around it.

- `vllm_layout(kv_caches, block_size)`: "vllm_cpu" (vLLM-CPU's packed blocks), "flash_attn" or
  "flashinfer" (CUDA); ValueError for anything else.
- `connector_kvcaches(kv_caches, block_size)`: the per-layer caches as the connector takes them.
- `platform_connector(...)`: the connector for a layout: MLA latent rows, vLLM-CPU's packed blocks
  (probed with vLLM's own kernel, or their closed form) or CUDA's paged layouts, copied through
  the staged, event-ordered path (a load never synchronises the host; vLLM's forward waits for it
  on its stream).
- `build_engine(vllm_config, config, ...)`: this process's engine (named `utils.ENGINE_NAME`),
  built on first call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.gpu_connector import GPUConnectorInterface, VLLMPagedMemGPUConnectorV2
from lmcache.integration.vllm.kv_groups import ModelKV
from lmcache.integration.vllm.utils import ENGINE_NAME, engine_metadata

VLLM_CPU_LAYOUT = "vllm_cpu"


def build_engine(vllm_config: Any, config: LMCacheEngineConfig, *, rank: int, kv_dtype: torch.dtype,
                 device: str, layout: str | None, model: ModelKV | None) -> LMCacheEngine:
    """This process's engine, built on first call (later calls return it). `layout`: vLLM's KV
    layout (`vllm_layout`, or "mla"; None: inferred from the caches the connector is given).
    `model`: the KV cache groups the connector serves (`kv_groups.model_kv`; None: one
    full-attention group of every layer)."""
    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    if engine is not None:
        return engine
    metadata = engine_metadata(vllm_config, config, kv_dtype, rank, model)
    if model is not None:
        block_size, layer_groups = model.token_groups[0].block_size, model.layer_groups
    else:
        block_size, layer_groups = vllm_config.cache_config.block_size, None
    connector = platform_connector(device, kv_dtype, metadata.kv_shape[3], metadata.kv_shape[4], block_size,
                                   metadata.num_layers, layout=layout, layer_groups=layer_groups)
    return LMCacheEngineBuilder.get_or_create(ENGINE_NAME, config, metadata, connector)


def platform_connector(device: str, dtype: torch.dtype, num_kv_heads: int, head_size: int, block_size: int,
                       num_layers: int, *, layout: str | None = None,
                       layer_groups: Sequence[int] | None = None) -> GPUConnectorInterface:
    """The connector for vLLM's caches on `device`: MLA latent rows (`layout` "mla"), vLLM-CPU's
    packed blocks (probed with vLLM's own kernel), or a paged connector of `layout`
    ("flash_attn", "flashinfer"; None: inferred from the caches it is given). `layer_groups`: each
    layer's KV cache group, for a ``[G, N]`` slot mapping (several groups: vLLM-CPU only)."""
    hidden = num_kv_heads * head_size
    if layout == "mla":
        return VLLMPagedMemGPUConnectorV2(hidden, num_layers, layout="mla")
    if device == "cpu" or layout == VLLM_CPU_LAYOUT:
        from lmcache.integration.vllm.cpu_connector import VLLMCPUPackedConnector
        from lmcache.integration.vllm.cpu_layout import packed_layout

        packed = packed_layout(num_kv_heads, head_size, block_size, dtype)
        return VLLMCPUPackedConnector(hidden, num_layers, packed, layer_groups=layer_groups)
    if layer_groups is not None and len(set(layer_groups)) > 1:
        raise ValueError(f"several KV cache groups on {device} are not supported (vLLM-CPU only)")
    return VLLMPagedMemGPUConnectorV2(hidden, num_layers, layout=layout)


def vllm_layout(kv_caches: list[torch.Tensor], block_size: int) -> str:
    """Which layout vLLM's per-layer caches are in: "vllm_cpu" (packed blocks on the CPU),
    "flash_attn" ``[2, num_blocks, bs, heads, head_size]`` or "flashinfer" ``[num_blocks, 2, bs,
    heads, head_size]``; ValueError for anything else."""
    first = kv_caches[0]
    if first.device.type == "cpu":
        return VLLM_CPU_LAYOUT
    if first.dim() == 5 and first.shape[0] == 2 and first.shape[2] == block_size:
        return "flash_attn"
    if first.dim() == 5 and first.shape[1] == 2 and first.shape[2] == block_size:
        return "flashinfer"
    raise ValueError(f"LMCache does not know vLLM's KV cache layout {tuple(first.shape)} on {first.device}")


def connector_kvcaches(kv_caches: list[torch.Tensor], block_size: int) -> list[torch.Tensor]:
    """vLLM's per-layer caches in the form the platform connector takes: as they are (every
    connector reads vLLM's own layout); ValueError for a layout it does not know."""
    vllm_layout(kv_caches, block_size)
    return list(kv_caches)
