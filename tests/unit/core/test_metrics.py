"""The engine's numbers as Prometheus metrics: the stats object, the standalone exporter, the
vLLM stats and Prometheus classes, and once-per-incident logging of failed requests."""

from __future__ import annotations

import logging
import threading
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from lmcache import observability
from lmcache.metrics import merge_intervals, rank_payload
from lmcache.observability import EngineStats, TierStats
from tests.helpers import WRITE_WAIT
from tests.helpers.paged_kv import PagedKV, build_engine
from tests.helpers.prometheus import metric_types


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_interval_reports_increments_once_and_current_gauges():
    tiers = {"Hot": TierStats({"evicted": 2}, {"bytes_used": 100})}
    stats = EngineStats(lambda: tiers)
    stats.add("stored_tokens", 5)
    stats.observe("store_seconds", 0.01)
    first = stats.interval()
    assert first["counters"] == {"stored_tokens": 5} and first["tier_counters"] == {"Hot": {"evicted": 2}}
    assert first["tier_gauges"] == {"Hot": {"bytes_used": 100}}
    assert first["observations"] == {"store_seconds": [0.01]}
    tiers["Hot"] = TierStats({"evicted": 3}, {"bytes_used": 50})
    stats.add("stored_tokens", 1)
    second = stats.interval()
    assert second["counters"] == {"stored_tokens": 1} and second["tier_counters"] == {"Hot": {"evicted": 1}}
    assert second["observations"] == {}


def test_observations_nobody_drains_are_bounded_and_still_counted():
    """Outside vLLM nobody drains the histograms (a scrape reads the buckets): the observations
    kept for `drain` must not grow with every request for the life of the process."""
    hist = observability.Histogram(observability.LATENCY_BUCKETS)
    kept = observability.UNDRAINED_MAX
    for _ in range(kept + 5):
        hist.observe(0.01)
    counts, total = hist.cumulative()
    assert counts[-1] == kept + 5 and total == pytest.approx(0.01 * (kept + 5))
    assert len(hist.drain()) == kept and hist.drain() == []


def test_counters_are_exact_under_concurrent_updates():
    stats = EngineStats()

    def bump():
        for _ in range(20000):
            stats.add("lookup_requests")

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.get("lookup_requests") == 80000


def test_merge_adds_counters_keeps_each_ranks_latest_gauges_and_joins_observations():
    a = {"counters": {"x": 1}, "tier_counters": {"Hot": {"hits": 2}},
         "gauges_by_rank": {"0": {"Hot": {"b": 1}}}, "observations": {"store_seconds": [0.1]}}
    b = {"counters": {"x": 2, "y": 1}, "tier_counters": {"Hot": {"hits": 1}},
         "gauges_by_rank": {"0": {"Hot": {"b": 5}}, "1": {"Hot": {"b": 7}}},
         "observations": {"store_seconds": [0.2]}}
    m = merge_intervals(a, b)
    assert m["counters"] == {"x": 3, "y": 1} and m["tier_counters"] == {"Hot": {"hits": 3}}
    assert m["gauges_by_rank"] == {"0": {"Hot": {"b": 5}}, "1": {"Hot": {"b": 7}}}
    assert m["observations"] == {"store_seconds": [0.1, 0.2]} and a["counters"] == {"x": 1}  # a untouched


@pytest.fixture
def engine(tmp_path):
    e = build_engine(8, metrics_port=0, local_disk=str(tmp_path), max_local_disk_size=0.01)
    yield e
    e.close()


def use(engine, n_tokens=24):
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (n_tokens,))
    slots = kv.slots_for(n_tokens)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    assert engine.storage_manager.backends["LocalDiskBackend"].puts.flush(WRITE_WAIT)
    assert engine.lookup(tokens) == n_tokens
    engine.retrieve(tokens, kvcaches=kv.empty_like().layers, slot_mapping=slots)


def test_the_standalone_exporter_serves_every_counter_gauge_and_histogram(engine):
    use(engine)
    got = scrape(engine.metrics_server.port)
    chunk = 2 * 2 * 8 * 8 * 2
    assert got[("lmcache:stored_tokens_total", ())] == 24
    assert got[("lmcache:lookup_hit_tokens_total", ())] == 24
    assert got[("lmcache:retrieve_hit_tokens_total", ())] == 24
    assert got[("lmcache:tier_hits_total", (("tier", "Hot"),))] == 3
    assert got[("lmcache:tier_bytes_read_total", (("tier", "Hot"),))] == 3 * chunk
    assert got[("lmcache:tier_bytes_written_total", (("tier", "LocalDiskBackend"),))] == 3 * chunk
    assert got[("lmcache:tier_bytes_used", (("tier", "LocalDiskBackend"),))] > 3 * chunk
    assert got[("lmcache:tier_bytes_used", (("tier", "Hot"),))] == 3 * 512
    assert got[("lmcache:retrieve_seconds_count", ())] == 1 and got[("lmcache:store_gbps_count", ())] == 1
    _, tiers = engine.stats.counters()
    for tier, counters in tiers.items():  # no counter left unread
        for name in counters:
            assert (f"lmcache:tier_{name}_total", (("tier", tier),)) in got


def test_vllm_stats_and_prometheus_classes_record_what_the_engine_counted(engine):
    pytest.importorskip("vllm")
    from lmcache.integration.vllm.metrics import LMCacheKVConnectorStats, LMCachePromMetrics

    registry = CollectorRegistry()

    use(engine)
    rank0 = LMCacheKVConnectorStats(data=rank_payload(engine.stats, 0))
    hot_then = engine.stats.tiers()["Hot"].gauges["bytes_used"]
    use(engine)
    rank1 = LMCacheKVConnectorStats(data=rank_payload(engine.stats, 1))
    total = rank0.aggregate(rank1)
    assert not total.is_empty() and total.reduce()["stored_tokens"] == 48
    types = metric_types(registry)
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = LMCachePromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["smol", "0"]})
    prom.observe(total.data, 0)
    labels = {"model_name": "smol", "engine": "0"}
    assert registry.get_sample_value("lmcache:stored_tokens_total", labels) == 48
    assert registry.get_sample_value("lmcache:tier_hits_total", {**labels, "tier": "Hot"}) == 6
    hot_now = engine.stats.tiers()["Hot"].gauges["bytes_used"]
    hot_metric = registry.get_sample_value("lmcache:tier_bytes_used", {**labels, "tier": "Hot"})
    assert hot_metric == hot_then + hot_now  # the ranks' gauges add up
    assert registry.get_sample_value("lmcache:retrieve_seconds_count", labels) == 2
    assert LMCacheKVConnectorStats(data={}).is_empty()


def test_failed_requests_are_counted_and_logged_once_per_incident(caplog):
    engine = build_engine(8, error_handling=True)
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    slots = kv.slots_for(16)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    with caplog.at_level(logging.DEBUG, logger="lmcache.cache_engine"):
        for _ in range(3):  # kvcaches of the wrong layer count: every retrieve fails
            assert int(engine.retrieve(tokens, kvcaches=kv.layers[:1], slot_mapping=slots).sum()) == 0
        engine.retrieve(tokens, kvcaches=kv.layers, slot_mapping=slots)  # works again
        engine.retrieve(tokens, kvcaches=kv.layers[:1], slot_mapping=slots)  # a new incident, soon after
    lines = [r for r in caplog.records if "LMCache engine" in r.getMessage() and " failed" in r.getMessage()]
    warnings = [r for r in lines if r.levelname == "WARNING"]
    assert engine.stats.get("errors") == 4 and len(warnings) == 1
    assert warnings[0].exc_info is not None  # the first of an incident carries the traceback
    assert lines[-1].levelname == "DEBUG"  # within a minute of the warning: not warned again
    engine.close()


def test_a_second_engine_in_the_process_takes_the_metric_names_over():
    pytest.importorskip("vllm")
    from lmcache.integration.vllm.metrics import LMCachePromMetrics

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}  # vLLM's default: the global registry
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    for _ in range(2):
        prom = LMCachePromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["smol", "0"]})
        prom.observe({"counters": {"stored_tokens": 3}}, 0)
    from prometheus_client import REGISTRY

    labels = {"model_name": "smol", "engine": "0"}
    assert REGISTRY.get_sample_value("lmcache:stored_tokens_total", labels) == 3


def test_an_older_engine_still_running_beside_a_newer_one_counts_on_unexported():
    """Two engines live in one process (started at once, say): the newer one's metrics hold the
    names; the older one's observations raise nothing and reach no registry."""
    pytest.importorskip("vllm")
    from prometheus_client import REGISTRY

    from lmcache.integration.vllm.metrics import LMCachePromMetrics

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    old, new = (LMCachePromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["smol", "0"]})
                for _ in range(2))
    for prom, n in ((new, 5), (old, 7), (new, 1)):
        prom.observe({"counters": {"stored_tokens": n}, "observations": {"retrieve_seconds": [0.01]}}, 0)
    labels = {"model_name": "smol", "engine": "0"}
    assert REGISTRY.get_sample_value("lmcache:stored_tokens_total", labels) == 6
    assert REGISTRY.get_sample_value("lmcache:retrieve_seconds_count", labels) == 2


def test_a_rank_that_reported_nothing_new_keeps_its_share_of_a_summed_gauge():
    """A worker whose numbers did not change sends no stats for the step (`stats_interval` is
    None): its last gauges still count in the sum over ranks."""
    pytest.importorskip("vllm")
    from lmcache.integration.vllm.metrics import LMCachePromMetrics

    registry = CollectorRegistry()
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = LMCachePromMetrics(vllm_config, metric_types(registry), ["model_name", "engine"],
                              {0: ["smol", "0"]})
    both = {"gauges_by_rank": {"0": {"Hot": {"bytes_used": 100}}, "1": {"Hot": {"bytes_used": 100}}}}
    prom.observe(both, 0)
    prom.observe({"gauges_by_rank": {"0": {"Hot": {"bytes_used": 150}}}}, 0)  # rank 1: unchanged
    labels = {"model_name": "smol", "engine": "0", "tier": "Hot"}
    assert registry.get_sample_value("lmcache:tier_bytes_used", labels) == 250
