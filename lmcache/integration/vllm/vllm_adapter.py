"""Seed 004's adapter names, working on vLLM v1's terms.

vLLM v0 called these around its model runner with a `model_input`; v1 has no such object and
drives KV connectors instead. Here `model_input` is the v1 step plan that the scheduler side sends
the workers (`LMCacheConnectorMetadata`) and `kv_caches` are vLLM's per-layer cache tensors. The
v1 connector's worker side builds its engine with `init_lmcache_engine` and moves KV with the same
functions `lmcache_retrieve_kv` / `lmcache_store_kv` use (`transfer.load_plan` / `save_plan`).

- `init_lmcache_engine(model_config, parallel_config, cache_config)`: this process's engine
  (named `utils.ENGINE_NAME`), built on first call: the connector matches the platform's paged
  layout (`vllm_layout`: vLLM-CPU's packed blocks, probed or from their closed form; or CUDA's
  flash-attention / FlashInfer layouts, copied through the staged, event-ordered path: a load
  never synchronises the host, vLLM's forward waits for it on its stream).
- `lmcache_should_retrieve` / `lmcache_should_store`: a status per planned request.
- `lmcache_retrieve_kv(...) -> (model_input, bypass_model_exec, hidden_states)`: loads what is
  planned; `bypass_model_exec` is always False because v1 always computes at least one token.
- `lmcache_store_kv(...)`: stores what is planned.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.gpu_connector import GPUConnectorInterface, VLLMPagedMemGPUConnectorV2
from lmcache.integration.vllm.kv_groups import GroupKind, KVGroup, ModelKV
from lmcache.integration.vllm.metadata import LMCacheConnectorMetadata
from lmcache.integration.vllm.transfer import load_plan, save_plan
from lmcache.integration.vllm.utils import ENGINE_NAME, engine_metadata

VLLM_CPU_LAYOUT = "vllm_cpu"


class RetrieveStatus(enum.Enum):
    PREFILL = 1
    CHUNK_PREFILL = 2
    NONE = 3


class StoreStatus(enum.Enum):
    PREFILL = 1
    CHUNK_PREFILL = 2
    DECODE = 3
    SUFFIX_PREFILL = 4
    NONE = 5


class _Configs:
    """The pieces of a VllmConfig that `engine_metadata` reads."""

    def __init__(self, model_config: Any, parallel_config: Any, cache_config: Any) -> None:
        self.model_config = model_config
        self.parallel_config = parallel_config
        self.cache_config = cache_config


def init_lmcache_engine(model_config: Any, parallel_config: Any, cache_config: Any, *,
                        config: LMCacheEngineConfig | None = None, rank: int = 0,
                        kv_dtype: torch.dtype | None = None, device: str | None = None,
                        layout: str | None = None, model: ModelKV | None = None) -> LMCacheEngine:
    """This process's engine, built on first call (config from LMCACHE_* env / file by default).
    `layout`: vLLM's KV layout (`vllm_layout`); by default the device's usual one. `model`: the
    KV cache groups the connector serves (`kv_groups.model_kv`; by default one full-attention
    group of every layer)."""
    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    if engine is not None:
        return engine
    config = config or LMCacheEngineConfig.load()
    dtype = kv_dtype or model_config.dtype
    device = device or ("cpu" if not torch.cuda.is_available() else "cuda")
    metadata = engine_metadata(_Configs(model_config, parallel_config, cache_config), config, dtype, rank,
                               model)
    block_size = model.token_groups[0].block_size if model is not None else cache_config.block_size
    connector = platform_connector(device, dtype, metadata.kv_shape[3], metadata.kv_shape[4], block_size,
                                   metadata.num_layers, layout=layout,
                                   layer_groups=model.layer_groups if model is not None else None)
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


def lmcache_should_retrieve(model_input: LMCacheConnectorMetadata) -> list[RetrieveStatus]:
    return [RetrieveStatus.PREFILL if p.has_load else RetrieveStatus.NONE for p in model_input.requests]


def lmcache_should_store(model_input: LMCacheConnectorMetadata) -> list[StoreStatus]:
    return [StoreStatus.PREFILL if p.has_save else StoreStatus.NONE for p in model_input.requests]


def lmcache_retrieve_kv(model_executable: Any, model_input: LMCacheConnectorMetadata, cache_config: Any,
                        kv_caches: list[torch.Tensor], retrieve_status: list[RetrieveStatus],
                        ) -> tuple[LMCacheConnectorMetadata, bool, None]:
    engine = _engine()
    kvcaches = connector_kvcaches(kv_caches, cache_config.block_size)
    for plan, status in zip(model_input.requests, retrieve_status, strict=True):
        if status != RetrieveStatus.NONE and plan.has_load:
            load_plan(engine, kvcaches, plan, _one_group(cache_config))
    return model_input, False, None


def lmcache_store_kv(model_config: Any, parallel_config: Any, cache_config: Any, model_executable: Any,
                     model_input: LMCacheConnectorMetadata, kv_caches: list[torch.Tensor],
                     store_status: list[StoreStatus]) -> None:
    engine = _engine()
    kvcaches = connector_kvcaches(kv_caches, cache_config.block_size)
    for plan, status in zip(model_input.requests, store_status, strict=True):
        if status != StoreStatus.NONE and plan.has_save:
            save_plan(engine, kvcaches, plan, _one_group(cache_config))


def _one_group(cache_config: Any) -> list[KVGroup]:
    """The seed's adapter serves one full-attention group (vLLM v0's view of a model)."""
    return [KVGroup(0, GroupKind.FULL, cache_config.block_size, ())]


def _engine() -> LMCacheEngine:
    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    if engine is None:
        raise RuntimeError("no LMCache engine in this process: call init_lmcache_engine first")
    return engine
