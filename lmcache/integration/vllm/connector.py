"""`LMCacheConnectorV1`: LMCache as a vLLM v1 KV connector.

    --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1",
                           "kv_connector_module_path": "lmcache.integration.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"lmcache.max_local_cpu_size": 4}}'

vLLM builds this class twice, in different processes: with the SCHEDULER role in the EngineCore
(`scheduler.LMCacheScheduler` does that side's work) and with the WORKER role in each worker
(`worker.LMCacheWorker`). Both parse the LMCache config, so a bad `kv_connector_extra_config` fails
at start-up with a ValueError naming the field. Loads are synchronous and happen before the forward;
saves happen after it; per-layer hooks have nothing to do. LMCache's metrics (``lmcache:...``) go
through vLLM's connector-metrics hooks into vLLM's own ``/metrics`` (`integration.vllm.metrics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
)

from lmcache.integration.vllm.metadata import LMCacheConnectorMetadata
from lmcache.integration.vllm.metrics import LMCacheKVConnectorStats, LMCachePromMetrics
from lmcache.integration.vllm.utils import lmcache_config_from_vllm

if TYPE_CHECKING:
    from lmcache.integration.vllm.scheduler import LMCacheScheduler
    from lmcache.integration.vllm.worker import LMCacheWorker


class LMCacheConnectorV1(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = lmcache_config_from_vllm(vllm_config)
        self._scheduler: LMCacheScheduler | None = None
        self._worker: LMCacheWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from lmcache.integration.vllm.scheduler import LMCacheScheduler

            self._scheduler = LMCacheScheduler(vllm_config, config)
        else:
            from vllm.distributed.parallel_state import get_world_group

            from lmcache.integration.vllm.worker import LMCacheWorker

            self._worker = LMCacheWorker(vllm_config, config, get_world_group().rank_in_group)

    @property
    def scheduler(self) -> LMCacheScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker-side connector"
        return self._scheduler

    @property
    def worker(self) -> LMCacheWorker:
        assert self._worker is not None, "worker-side call on a scheduler-side connector"
        return self._worker

    def _plan(self) -> LMCacheConnectorMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, LMCacheConnectorMetadata)
        return metadata

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # ---- metrics (see `integration.vllm.metrics`) ------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.stats_interval() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LMCacheKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type[PromMetric], type[Any]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return LMCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        """vLLM's reset of connector caches (``LLM.reset_prefix_cache(reset_connector=True)``,
        ``POST /reset_prefix_cache?reset_external=true``): with `clear_hot_on_reset`, empty the
        workers' hot tiers (True once every rank confirmed); otherwise LMCache keeps its cache
        (None: nothing to reset)."""
        return self.scheduler.reset_cache()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
