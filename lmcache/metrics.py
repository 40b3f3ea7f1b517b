"""LMCache's Prometheus metrics, made from one engine's `EngineStats`.

Every number the engine and its tiers keep becomes a metric (prefix ``lmcache:``):

    engine counters  lmcache:<name>_total             lookup_requests, lookup_hit_tokens,
                                                      stored_tokens, retrieve_hit_tokens, errors,
                                                      pd_sent_bytes, pd_send_failures, ...
    tier counters    lmcache:tier_<name>_total{tier}  hits, bytes_read, bytes_written, evicted,
                                                      failures, skipped, corrupt, forged, puts_written,
                                                      puts_failed, puts_dropped, ...
    tier gauges      lmcache:tier_<name>{tier}        bytes_used, chunks, files, puts_pending
    histograms       lmcache:<name>                   store_seconds, retrieve_seconds,
                                                      store_gbps, retrieve_gbps
    audits (vLLM)    lmcache:audits_total{tier, group_kind, result}   exact, within_rounding, mismatch

Two ways out, same names:
- inside vLLM the worker ships `EngineStats.interval()` with its connector stats and vLLM records
  them in its own registry with its own labels (`integration.vllm.metrics`), so they appear in
  vLLM's ``/metrics``;
- anywhere else (HF transformers, the engine alone) `MetricsServer` serves them with
  prometheus_client on `metrics_port`.

An interval payload (`EngineStats.interval`, plus a ``rank`` for its gauges) is plain data;
`merge_intervals` adds two of them up (over workers or over time).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from lmcache.observability import EngineStats

PREFIX = "lmcache:"
DOCS = {
    "lookup_requests": "Cache lookups of the serving engine (how many prefix tokens are cached?)",
    "lookup_hit_tokens": "Prefix tokens that lookups found cached",
    "store_requests": "Store requests",
    "stored_tokens": "Tokens whose KV was stored",
    "store_skipped_tokens": "Tokens not stored because a local tier held them already",
    "store_dropped_tokens": "Tokens not stored because the CPU arena was full of KV in use",
    "store_unkept_tokens": "Tokens not stored because vLLM no longer held their sliding-window KV",
    "stored_states": "Recurrent-layer states stored at chunk boundaries (hybrid models)",
    "store_dropped_states": "Recurrent-layer states not stored because the CPU arena was full",
    "retrieved_states": "Recurrent-layer states retrieved into the serving engine",
    "retrieve_requests": "Retrieve requests",
    "retrieve_requested_tokens": "Tokens retrieves asked for",
    "retrieve_hit_tokens": "Tokens whose KV was retrieved into the serving engine",
    "errors": "Requests the cache could not serve because of a failure (each was a miss)",
    "load_error_blocks": "KV blocks reported to vLLM as failed loads (vLLM recomputed them)",
    "kv_events_unknown_chunks": "Chunks left out of vLLM's KV events (their blocks unknown)",
    "pd_sent_requests": "Prompts whose KV the PD sender offered to a decoder's receiver",
    "pd_sent_bytes": "Bytes of KV the PD sender wrote into a receiver",
    "pd_sent_nixl_bytes": "Bytes of KV the PD sender wrote through NIXL (of pd_sent_bytes)",
    "pd_had_bytes": "Bytes of KV not sent because the receiver held them already",
    "pd_skipped_bytes": "Bytes of KV not sent: the receive buffer stayed full for pd_send_timeout, or the "
                        "receiver serves another model (the decoder computed them)",
    "pd_send_failures": "Sends to a KV receiver that failed (refused, broken, timed out; the decoder "
                        "computed that KV)",
    "pd_send_skipped": "Sends not made because the failing receiver was backed off from",
    "tier_hits": "Chunks a tier served",
    "tier_bytes_read": "Bytes of KV a tier served",
    "tier_bytes_written": "Bytes of KV written to a tier",
    "tier_evicted": "Chunks a tier evicted",
    "tier_failures": "Calls into a tier that failed (each was a miss)",
    "tier_skipped": "Calls into a tier not made because the failing part was backed off from (misses)",
    "tier_puts_written": "Chunks written to a tier",
    "tier_puts_failed": "Chunk writes to a tier that failed",
    "tier_puts_dropped": "Chunk writes to a tier not made (queue full, backing off, or no room in the store)",
    "tier_too_large": "Chunk writes a tier refused as larger than all of its room (of tier_puts_dropped)",
    "tier_no_room": "Chunk writes a tier had no room for without evicting pinned chunks (of "
                    "tier_puts_dropped)",
    "tier_corrupt": "Corrupt or unverifiable values a tier detected (each was a miss)",
    "tier_forged": "Sealed values that did not open (forged, moved, truncated, retired key; each was a "
                   "miss, also counted as corrupt)",
    "tier_bytes_used": "Bytes a tier holds",
    "store_seconds": "Seconds one store took",
    "retrieve_seconds": "Seconds one retrieve took",
    "store_gbps": "GB/s of one store",
    "retrieve_gbps": "GB/s of one retrieve",
    "audits": "Audited chunks (or recurrent states) by tier, KV cache group kind and result: exact, "
              "within_rounding (the dtype's rounding) or mismatch (the chunk was deleted)",
}


def engine_metric(name: str) -> str:
    return PREFIX + name


def tier_metric(name: str) -> str:
    return PREFIX + "tier_" + name


def doc(name: str) -> str:
    return DOCS.get(name, name.replace("_", " "))


def merge_intervals(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """`a` and `b` added up: counters summed, each rank's gauges the latest, observations joined."""
    out = copy.deepcopy(a)
    for name, n in b.get("counters", {}).items():
        out.setdefault("counters", {})[name] = out.get("counters", {}).get(name, 0) + n
    for tier, counters in b.get("tier_counters", {}).items():
        mine = out.setdefault("tier_counters", {}).setdefault(tier, {})
        for name, n in counters.items():
            mine[name] = mine.get(name, 0) + n
    for rank, gauges in b.get("gauges_by_rank", {}).items():
        out.setdefault("gauges_by_rank", {})[rank] = gauges
    for name, values in b.get("observations", {}).items():
        out.setdefault("observations", {}).setdefault(name, []).extend(values)
    for tier, kinds in b.get("audits", {}).items():
        for kind, results in kinds.items():
            mine = out.setdefault("audits", {}).setdefault(tier, {}).setdefault(kind, {})
            for result, n in results.items():
                mine[result] = mine.get(result, 0) + n
    return out


def rank_payload(stats: EngineStats, rank: int) -> dict[str, Any]:
    """`stats.interval()` with its tier gauges filed under `rank` (workers' gauges add up)."""
    interval = stats.interval()
    gauges = interval.pop("tier_gauges")
    return {**interval, "gauges_by_rank": {str(rank): gauges}}


def summed_gauges(payload: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Tier gauges summed over ranks: {tier: {name: value}}."""
    out: dict[str, dict[str, float]] = {}
    for gauges in payload.get("gauges_by_rank", {}).values():
        for tier, values in gauges.items():
            mine = out.setdefault(tier, {})
            for name, v in values.items():
                mine[name] = mine.get(name, 0) + v
    return out


class _Collector(Collector):
    """Reads an engine's stats at every scrape (cumulative counters, current gauges)."""

    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        engine, tiers = self.stats.counters()
        for name, value in sorted(engine.items()):
            yield CounterMetricFamily(engine_metric(name), doc(name), value=value)
        families: dict[str, Any] = {}
        for tier, counters in tiers.items():
            for name, value in counters.items():
                family = families.setdefault(name, CounterMetricFamily(
                    tier_metric(name), doc("tier_" + name), labels=["tier"]))
                family.add_metric([tier], value)
        gauges: dict[str, Any] = {}
        for tier, tier_stats in self.stats.tiers().items():
            for name, value in tier_stats.gauges.items():
                family = gauges.setdefault(name, GaugeMetricFamily(
                    tier_metric(name), doc("tier_" + name), labels=["tier"]))
                family.add_metric([tier], value)
        yield from families.values()
        yield from gauges.values()
        for name, hist in self.stats.histograms.items():
            counts, total = hist.cumulative()
            buckets = [(str(b), c) for b, c in zip(hist.buckets, counts, strict=False)]
            buckets.append(("+Inf", counts[-1]))
            yield HistogramMetricFamily(engine_metric(name), doc(name), buckets=buckets, sum_value=total)


class MetricsServer:
    """An engine's metrics over HTTP (``GET /metrics``, Prometheus text) on `host:port` (port 0 =
    any free port; `port` is the bound one)."""

    def __init__(self, stats: EngineStats, host: str, port: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(stats))
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.port = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
