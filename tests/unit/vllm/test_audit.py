"""Self-verification (`integration.vllm.audit`) without a model: which lookups are audited, how
chunks compare, and what an audit does with a chunk that differs."""

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch

from lmcache.config import LMCacheEngineConfig
from lmcache.integration.vllm.audit import ROUNDING_ULPS, Auditor, Result, compare, selected
from lmcache.integration.vllm.kv_groups import GroupKind, KVGroup, ModelKV
from lmcache.integration.vllm.metadata import RequestPlan
from tests.helpers.paged_kv import PagedKV, build_engine


@pytest.mark.parametrize("rate", [0.0, 0.01, 0.25, 0.5, 1.0])
def test_a_rate_audits_exactly_that_fraction_of_lookups_spread_evenly(rate):
    picks = [n for n in range(1000) if selected(n, rate)]
    assert len(picks) == round(1000 * rate)
    if len(picks) > 1:
        gaps = {b - a for a, b in itertools.pairwise(picks)}
        assert max(gaps) - min(gaps) <= 1


@pytest.mark.parametrize(("field", "value"), [("verify_rate", -0.1), ("verify_rate", 1.5),
                                              ("verify_rate", float("nan")), ("verify_max_mismatches", 0),
                                              ("verify_seed", -1)])
def test_bad_verify_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"invalid config value {field}="):
        LMCacheEngineConfig.from_defaults(**{field: value})


def test_chunks_compare_exact_within_rounding_or_mismatch_naming_the_worst_layer():
    gen = torch.Generator().manual_seed(0)
    fresh = torch.randn(2, 3, 16, 8, generator=gen)
    assert compare(fresh, fresh.clone(), 64).result == Result.EXACT
    rounded = fresh.clone()
    rounded[1, 2, 5, 3] = torch.nextafter(rounded[1, 2, 5, 3], torch.tensor(1e9))
    diff = compare(fresh, rounded, ROUNDING_ULPS[torch.float32])
    assert (diff.result, diff.layer) == (Result.WITHIN_ROUNDING, 2) and 0 < diff.ulps <= 1
    flipped = fresh.clone()
    flipped.view(torch.uint8)[0, 1, 7, 10] ^= 0x40  # one bit of one byte (a high mantissa bit)
    diff = compare(fresh, flipped, ROUNDING_ULPS[torch.float32])
    assert (diff.result, diff.layer) == (Result.MISMATCH, 1) and diff.max_abs > 0
    assert compare(fresh, fresh[:, :, :8], 64).result == Result.MISMATCH
    assert compare(fresh, fresh.to(torch.bfloat16), 64).result == Result.MISMATCH


def auditor_over(rate=1.0, max_mismatches=1, seed=0):
    engine = build_engine(8, error_handling=True)
    kv = PagedKV()
    model = ModelKV("llama", (KVGroup(0, GroupKind.FULL, kv.block_size, ("l.0", "l.1")),), kv.heads,
                    kv.head_size, kv.dtype)
    return engine, kv, Auditor(engine, model, rate=rate, max_mismatches=max_mismatches, seed=seed)


def plan_of(tokens, slots, kv, rid="r", **fields):
    blocks = (slots[:: kv.block_size] // kv.block_size).tolist()
    return RequestPlan(rid, tokens.tolist(), [blocks], save_from=0, save_to=len(tokens), **fields)


def test_an_audited_lookup_answers_0_once_per_request_and_its_save_stores_nothing_it_audits():
    engine, kv, auditor = auditor_over(rate=0.5, seed=1)
    assert auditor.answer("a", 24) == 0  # lookup 1 of rate 0.5: audited
    assert auditor.answer("a", 24) == 0  # asked again: the same answer
    assert auditor.answer("b", 24) == 24  # lookup 2: served
    assert auditor.answer("c", 0) == 0 and auditor.audited("c") == 0  # nothing cached: nothing to audit
    tokens = torch.randint(0, 1000, (24,))
    slots = kv.slots_for(24)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    rest = auditor.capture(plan_of(tokens, slots, kv, rid="a"), kv.layers)
    assert not rest.has_save  # all 3 chunks audited instead of stored
    assert auditor.wait_idle(10)
    assert auditor.counts() == {"Hot": {"full": {"exact": 3}}}
    auditor.finished({"a"})
    assert auditor.audited("a") == 0
    auditor.close()
    engine.close()


def test_a_chunk_that_differs_is_a_mismatch_logged_once_deleted_and_hits_stop(caplog):
    engine, kv, auditor = auditor_over(rate=1.0, max_mismatches=1)
    tokens = torch.randint(0, 1000, (24,))
    slots = kv.slots_for(24)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    assert auditor.answer("a", engine.lookup(tokens)) == 0
    kv.layers[1][0, slots[10] // kv.block_size, slots[10] % kv.block_size, 1, 2] += 1  # chunk 1, layer 1
    with caplog.at_level(logging.WARNING):
        auditor.capture(plan_of(tokens, slots, kv, rid="a"), kv.layers)
        assert auditor.wait_idle(10)
    assert auditor.counts() == {"Hot": {"full": {"exact": 2, "mismatch": 1}}}
    assert engine.lookup(tokens) == 8  # the chunk is gone: never served again
    mismatch = [r.getMessage() for r in caplog.records if "audit mismatch:" in r.getMessage()]
    assert len(mismatch) == 1 and "layer 1 (l.1)" in mismatch[0] and "tier Hot" in mismatch[0]
    stops = [r for r in caplog.records if "stops serving cache hits" in r.getMessage()]
    assert len(stops) == 1 and auditor.stopped
    assert auditor.answer("later", 8) == 0  # hits stop for every lookup
    auditor.close()
    engine.close()


def test_an_engine_with_a_tier_that_codes_kv_lossily_is_not_audited(tmp_path, caplog):
    """A CacheGen-coded disk tier holds an approximation of the KV (its quantization), and so does
    the hot tier once a disk hit is promoted into it: every audit would be a mismatch, delete the
    chunk and soon stop all hits. Such an engine is not audited (one message); hits are served."""
    engine = build_engine(8, error_handling=True, local_disk=str(tmp_path), max_local_disk_size=0.01,
                          local_disk_serde="cachegen")
    kv = PagedKV()
    model = ModelKV("llama", (KVGroup(0, GroupKind.FULL, kv.block_size, ("l.0", "l.1")),), kv.heads,
                    kv.head_size, kv.dtype)
    with caplog.at_level("INFO", logger="lmcache.integration.vllm.audit"):
        auditor = Auditor(engine, model, rate=1.0, max_mismatches=1, seed=0)
    assert "self-verification is off: LocalDiskBackend" in caplog.text
    tokens = torch.randint(0, 1000, (24,))
    slots = kv.slots_for(24)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    assert auditor.answer("a", engine.lookup(tokens)) == 24
    auditor.capture(plan_of(tokens, slots, kv, rid="a"), kv.layers)
    assert auditor.wait_idle(10)
    assert auditor.counts() == {} and not auditor.stopped
    auditor.close()
    engine.close()


def test_chunks_vllms_own_prefix_cache_served_are_not_audited():
    engine, kv, auditor = auditor_over()
    tokens = torch.randint(0, 1000, (24,))
    slots = kv.slots_for(24)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    auditor.answer("a", 24)
    rest = auditor.capture(plan_of(tokens, slots, kv, rid="a", fresh_from=12), kv.layers)
    assert (rest.save_from, rest.save_to) == (24, 24)
    assert auditor.wait_idle(10)
    assert auditor.counts() == {"Hot": {"full": {"exact": 1}}}  # chunk [16, 24) only
    auditor.close()
    engine.close()


def test_audits_add_up_over_ranks_and_reach_prometheus_by_tier_group_kind_and_result():
    from prometheus_client import CollectorRegistry

    from lmcache.integration.vllm.metrics import LMCacheKVConnectorStats, LMCachePromMetrics
    from tests.helpers.prometheus import metric_types

    registry = CollectorRegistry()

    rank0 = LMCacheKVConnectorStats(data={"audits": {"Hot": {"full": {"exact": 2, "mismatch": 1}}}})
    rank1 = LMCacheKVConnectorStats(data={"audits": {"Hot": {"full": {"exact": 1}},
                                                     "RemoteBackend": {"sliding": {"within_rounding": 4}}}})
    total = rank0.aggregate(rank1)
    assert not total.is_empty()
    assert total.reduce() == {"audits_exact": 3, "audits_mismatch": 1, "audits_within_rounding": 4}
    types = metric_types(registry)
    prom = LMCachePromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                              {0: ["smol", "0"]})
    prom.observe(total.data, 0)
    prom.observe(total.data, 0)  # the same again, as a later interval: counters add
    labels = {"model_name": "smol", "engine": "0"}

    def sample(tier, kind, result):
        return registry.get_sample_value("lmcache:audits_total", {**labels, "tier": tier, "group_kind": kind,
                                                                  "result": result})

    assert sample("Hot", "full", "exact") == 3 + 3 and sample("Hot", "full", "mismatch") == 1 + 1
    assert sample("RemoteBackend", "sliding", "within_rounding") == 4 + 4


def test_once_hits_stopped_lookups_answer_0_and_only_the_rate_of_them_are_audited():
    """After the mismatch limit every lookup answers 0, but audits go on at `rate`: each audited
    request copies its fresh KV out on the request path, so auditing all of them (as it did) taxed
    every request and filled the queue."""
    engine, _, auditor = auditor_over(rate=0.25)
    auditor.stopped = True
    answers = [auditor.answer(f"r{i}", 24) for i in range(8)]
    assert answers == [0] * 8
    assert sum(auditor.audited(f"r{i}") > 0 for i in range(8)) == 2
    auditor.close()
    engine.close()
