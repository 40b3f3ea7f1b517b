"""Seed 004's adapter names, working on vLLM v1's terms (seed path:
`lmcache.integration.vllm.vllm_adapter`).

vLLM v0 called these around its model runner with a `model_input`; v1 has no such object and
drives KV connectors instead. Here `model_input` is the v1 step plan that the scheduler side sends
the workers (`LMCacheConnectorMetadata`) and `kv_caches` are vLLM's per-layer cache tensors. They
wrap what the v1 connector's worker side uses: `engine_setup.build_engine` and
`transfer.load_plan` / `save_plan`.

- `init_lmcache_engine(model_config, parallel_config, cache_config)`: this process's engine
  (named `utils.ENGINE_NAME`), built on first call by `engine_setup.build_engine`, with a
  connector for the platform's paged layout.
- `lmcache_should_retrieve` / `lmcache_should_store`: a status per planned request.
- `lmcache_retrieve_kv(...) -> (model_input, bypass_model_exec, hidden_states)`: loads what is
  planned; `bypass_model_exec` is always False because v1 always computes at least one token.
- `lmcache_store_kv(...)`: stores what is planned.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.vllm.engine_setup import build_engine, connector_kvcaches
from lmcache.integration.vllm.kv_groups import GroupKind, KVGroup, ModelKV
from lmcache.integration.vllm.metadata import LMCacheConnectorMetadata
from lmcache.integration.vllm.transfer import load_plan, save_plan
from lmcache.integration.vllm.utils import ENGINE_NAME


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
    """The pieces of a VllmConfig that `engine_setup.build_engine` reads."""

    def __init__(self, model_config: Any, parallel_config: Any, cache_config: Any) -> None:
        self.model_config = model_config
        self.parallel_config = parallel_config
        self.cache_config = cache_config


def init_lmcache_engine(model_config: Any, parallel_config: Any, cache_config: Any, *,
                        config: LMCacheEngineConfig | None = None, rank: int = 0,
                        kv_dtype: torch.dtype | None = None, device: str | None = None,
                        layout: str | None = None, model: ModelKV | None = None) -> LMCacheEngine:
    """This process's engine, built on first call (`engine_setup.build_engine`; config from
    LMCACHE_* env / file by default). `layout`: vLLM's KV layout (`vllm_layout`); by default the
    device's usual one. `model`: the KV cache groups the connector serves (`kv_groups.model_kv`;
    by default one full-attention group of every layer)."""
    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    if engine is not None:
        return engine
    return build_engine(_Configs(model_config, parallel_config, cache_config),
                        config or LMCacheEngineConfig.load(), rank=rank,
                        kv_dtype=kv_dtype or model_config.dtype,
                        device=device or ("cuda" if torch.cuda.is_available() else "cpu"),
                        layout=layout, model=model)


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
