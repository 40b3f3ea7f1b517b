"""`LMCacheConnectorV1`: LMCache as a vLLM v1 KV connector.

    --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1",
                           "kv_connector_module_path": "lmcache.integration.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"lmcache.max_local_cpu_size": 4}}'

vLLM builds this class twice, in different processes: with the SCHEDULER role in the EngineCore
(`scheduler.LMCacheScheduler` does that side's work) and with the WORKER role in each worker
(`worker.LMCacheWorker`). Both parse the LMCache config, so a bad `kv_connector_extra_config` fails
at start-up with a ValueError naming the field. Loads happen before the forward (after it, for a
model of several KV cache groups, whose loads vLLM waits for as asynchronous ones); saves happen
after it; per-layer hooks have nothing to do. LMCache's metrics (``lmcache:...``) go
through vLLM's connector-metrics hooks into vLLM's own ``/metrics`` (`integration.vllm.metrics`).
With vLLM's KV events on (``--kv-events-config``), what LMCache's tiers store and drop is
published with vLLM's own events (`integration.vllm.kv_events`). The engine core and worker
processes the connector lives in exit without the interpreter's last garbage collection
(`lmcache.process_exit`): seconds each, which vLLM's shutdown otherwise waits for or cuts short.

The connector implements `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on and gives it
every KV cache group. Both sides read the groups (`kv_groups.model_kv`); a model the connector
cannot serve exactly is refused at start-up with one message (logged by the scheduler side), and
the connector stays inactive: it finds nothing, stores nothing, and vLLM serves every request
without it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
)

from lmcache.integration.vllm.kv_events import SchedulerEvents, events_enabled
from lmcache.integration.vllm.kv_groups import ModelKV, UnsupportedModel, model_kv
from lmcache.integration.vllm.metadata import LMCacheConnectorMetadata
from lmcache.integration.vllm.metrics import LMCacheKVConnectorStats, LMCachePromMetrics
from lmcache.integration.vllm.utils import lmcache_config_from_vllm
from lmcache.process_exit import skip_final_collection_in_child

if TYPE_CHECKING:
    from lmcache.integration.vllm.scheduler import LMCacheScheduler
    from lmcache.integration.vllm.worker import LMCacheWorker

logger = logging.getLogger(__name__)


class LMCacheConnectorV1(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = lmcache_config_from_vllm(vllm_config)
        skip_final_collection_in_child()  # vLLM's engine core and workers exit in time
        self._scheduler: LMCacheScheduler | None = None
        self._worker: LMCacheWorker | None = None
        self.kv: ModelKV | None = None
        scheduler_events = role == KVConnectorRole.SCHEDULER and events_enabled(vllm_config)
        self._events = SchedulerEvents(vllm_config.parallel_config.world_size) if scheduler_events else None
        try:
            self.kv = model_kv(vllm_config, kv_cache_config, config)
        except UnsupportedModel as e:
            if role == KVConnectorRole.SCHEDULER:  # one message per engine, from the EngineCore
                logger.error("%s", e)
            return
        if role == KVConnectorRole.SCHEDULER:
            from lmcache.integration.vllm.scheduler import LMCacheScheduler

            self._scheduler = LMCacheScheduler(vllm_config, config, self.kv)
        else:
            from vllm.distributed.parallel_state import get_world_group

            from lmcache.integration.vllm.worker import LMCacheWorker

            self._worker = LMCacheWorker(vllm_config, config, get_world_group().rank_in_group, self.kv)

    def _plan(self) -> LMCacheConnectorMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, LMCacheConnectorMetadata)
        return metadata

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.get_transfer_results(finished_req_ids)

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self._worker.take_events() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

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
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._events is not None and connector_output.kv_cache_events is not None:
            self._events.add(connector_output.kv_cache_events)
        if self._scheduler is not None and connector_output.failed_recving:
            self._scheduler.loads_failed(connector_output.failed_recving)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """LMCache's tiers' KV events the workers reported since the last call (vLLM publishes
        them with its own)."""
        return self._events.take() if self._events is not None else ()

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._scheduler is None:
            return LMCacheConnectorMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`'s end of a request (every group's blocks): saves are synchronous, so the
        blocks are never held."""
        if self._scheduler is None:
            return False, None
        return False, self._scheduler.request_finished(request)

    def reset_cache(self) -> bool | None:
        """vLLM's reset of connector caches (``LLM.reset_prefix_cache(reset_connector=True)``,
        ``POST /reset_prefix_cache?reset_external=true``): with `clear_hot_on_reset`, empty the
        workers' hot tiers (True once every rank confirmed); otherwise LMCache keeps its cache
        (None: nothing to reset)."""
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
