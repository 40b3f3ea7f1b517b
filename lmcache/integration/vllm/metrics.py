"""LMCache's metrics inside vLLM, through vLLM's own connector-metrics hooks.

- Each worker's connector returns an `LMCacheKVConnectorStats` from `get_kv_connector_stats`
  (vLLM asks after every step): what its engine counted since the last time
  (`metrics.rank_payload`), or None when nothing changed.
- vLLM adds those up over workers and intervals (`aggregate`), logs `reduce()`'s summary with its
  periodic stats, and hands the sum to `LMCachePromMetrics.observe` in the process that serves
  ``/metrics``: counters increase, gauges (summed over ranks, a rank that sent nothing new with
  its last values) are set, histograms observe. Metric names are `lmcache.metrics`'; labels are
  vLLM's (model name, engine index) plus ``tier`` for the tier metrics; audits
  (`integration.vllm.audit`) are ``lmcache:audits_total`` with ``tier``, ``group_kind`` and
  ``result``. Metrics are created the first time a name is seen; like vLLM's own, they are
  registered anew when another engine starts in the same process: the newest engine's metrics hold
  the names, an older engine still running there counts on in metrics no registry exports.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
)

from lmcache.metrics import PREFIX, doc, engine_metric, merge_intervals, summed_gauges, tier_metric
from lmcache.observability import HISTOGRAMS


@dataclass
class LMCacheKVConnectorStats(KVConnectorStats):
    """`data` is an interval payload (see `lmcache.metrics`)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge_intervals(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data.get("counters", {}))
        for name, values in self.data.get("observations", {}).items():
            if values:
                out[f"{name}_median"] = round(statistics.median(values), 4)
        for kinds in self.data.get("audits", {}).values():
            for results in kinds.values():
                for result, n in results.items():
                    out[f"audits_{result}"] = out.get(f"audits_{result}", 0) + n
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not (d.get("counters") or d.get("tier_counters") or d.get("observations")
                    or d.get("gauges_by_rank") or d.get("audits"))


_names_lock = threading.Lock()
_names_owner: LMCachePromMetrics | None = None  # the newest engine's metrics in this process


class LMCachePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[Any]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        global _names_owner
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        # each engine's latest gauges of each rank: a rank with nothing new sends no stats
        self._gauges_by_rank: dict[int, dict[str, Any]] = {}
        histogram_cls: Any = self._histogram_cls
        with _names_lock:  # engines may start at once
            _unregister_lmcache_metrics()  # a newer engine in this process takes the names over, as vLLM does
            _names_owner = self
            for name, buckets in HISTOGRAMS.items():
                self._metrics[name] = histogram_cls(name=engine_metric(name), documentation=doc(name),
                                                    labelnames=labelnames, buckets=list(buckets))

    def _metric(self, kind: type, full_name: str, documentation: str, tier: bool,
                extra_labels: tuple[str, ...] = ()) -> Any:
        metric = self._metrics.get(full_name)
        if metric is None:
            labels = [*self._labelnames, *(["tier"] if tier else []), *extra_labels]
            with _names_lock:
                if _names_owner is self:
                    cls = self._counter_cls if kind is Counter else self._gauge_cls
                    metric = cls(name=full_name, documentation=documentation, labelnames=labels)
                else:  # a newer engine holds the name: count on where no registry exports it
                    metric = kind(name=full_name, documentation=documentation, labelnames=labels,
                                  registry=None)
                self._metrics[full_name] = metric
        return metric

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, n in transfer_stats_data.get("counters", {}).items():
            self._metric(Counter, engine_metric(name), doc(name), False).labels(*labels).inc(n)
        for tier, counters in transfer_stats_data.get("tier_counters", {}).items():
            for name, n in counters.items():
                metric = self._metric(Counter, tier_metric(name), doc("tier_" + name), True)
                metric.labels(*labels, tier).inc(n)
        ranks = self._gauges_by_rank.setdefault(engine_idx, {})
        ranks.update(transfer_stats_data.get("gauges_by_rank", {}))
        for tier, gauges in summed_gauges({"gauges_by_rank": ranks}).items():
            for name, value in gauges.items():
                metric = self._metric(Gauge, tier_metric(name), doc("tier_" + name), True)
                metric.labels(*labels, tier).set(value)
        for tier, kinds in transfer_stats_data.get("audits", {}).items():
            audits = self._metric(Counter, engine_metric("audits"), doc("audits"), True,
                                  ("group_kind", "result"))
            for kind, results in kinds.items():
                for result, n in results.items():
                    audits.labels(*labels, tier, kind, result).inc(n)
        for name, values in transfer_stats_data.get("observations", {}).items():
            histogram: Histogram = self._metrics[name]
            for value in values:
                histogram.labels(*labels).observe(value)


def _unregister_lmcache_metrics() -> None:
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)
