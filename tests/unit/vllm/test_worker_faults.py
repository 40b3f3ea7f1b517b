"""The worker side never lets a cache fault reach vLLM: failed loads become recompute requests."""

from types import SimpleNamespace

import torch

from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.integration.vllm.kv_groups import GroupKind, KVGroup, ModelKV
from lmcache.integration.vllm.metadata import RequestPlan
from lmcache.integration.vllm.worker import LMCacheWorker
from tests.helpers.paged_kv import PagedKV, build_engine


class BrokenConnector(VLLMPagedMemGPUConnectorV2):
    def batched_from_gpu(self, *args, **kwargs):
        raise RuntimeError("injected save failure")

    def batched_to_gpu(self, *args, **kwargs):
        raise RuntimeError("injected load failure")


def worker_over(engine, kv, groups=1):
    """A worker around `engine` whose model has `groups` full-attention KV cache groups."""
    kinds = tuple(KVGroup(g, GroupKind.FULL, kv.block_size, (f"l.{g}",)) for g in range(groups))
    model = ModelKV("llama", kinds, kv.heads, kv.head_size, kv.dtype)
    worker = LMCacheWorker(SimpleNamespace(), engine.config, rank=0, kv=model)
    worker.engine, worker.kvcaches = engine, kv.layers
    return worker


def test_a_failing_load_reports_its_blocks_for_recompute_and_does_not_raise():
    engine = build_engine(8, error_handling=True)  # as the connector always runs it
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    slots = kv.slots_for(16)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    engine.gpu_connector = BrokenConnector(8, 2)
    worker = worker_over(engine, kv)
    blocks = (slots[:: kv.block_size] // kv.block_size).tolist()
    plan = RequestPlan("r", tokens.tolist(), [blocks], load_from=4, load_to=15, retrieve_to=16)
    assert worker.load(plan) == 4
    assert worker.get_block_ids_with_load_errors() == set(blocks[1:4])
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    results = worker.get_transfer_results(set())
    assert not results.finished_recving and not results.failed_recving  # a synchronous load
    engine.close()


def test_a_failing_asynchronous_load_is_reported_by_request():
    """With several KV cache groups vLLM recovers only a failed load reported by request."""
    engine = build_engine(8, error_handling=True)
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    slots = kv.slots_for(16)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    engine.gpu_connector = BrokenConnector(8, 2)
    worker = worker_over(engine, kv, groups=2)
    blocks = (slots[:: kv.block_size] // kv.block_size).tolist()
    failing = RequestPlan("r", tokens.tolist(), [blocks, blocks], load_from=0, load_to=15, retrieve_to=16,
                          load_async=True)
    assert worker.load(failing) == 0
    assert worker.get_block_ids_with_load_errors() == set()
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"r"} and results.failed_recving == {"r"}
    assert worker.get_transfer_results(set()).finished_recving == set()  # reported once
    engine.close()


def test_a_failing_save_is_logged_not_raised():
    engine = build_engine(8, error_handling=True)
    engine.gpu_connector = BrokenConnector(8, 2)
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    blocks = (kv.slots_for(16)[:: kv.block_size] // kv.block_size).tolist()
    worker_over(engine, kv).save(RequestPlan("s", tokens.tolist(), [blocks], save_from=0, save_to=16))
    assert engine.lookup(tokens) == 0 and engine.stats.get("errors") == 1
    engine.close()


def test_a_bug_in_the_workers_own_code_is_a_miss_counted_by_the_engine(monkeypatch):
    """The worker has no catch of its own: its load and save run under the engine's `bugs`."""
    engine = build_engine(8, error_handling=True)
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    slots = kv.slots_for(16)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)

    def broken(*args, **kwargs):
        raise KeyError("injected bug")

    monkeypatch.setattr("lmcache.integration.vllm.worker.load_plan", broken)
    worker = worker_over(engine, kv)
    blocks = (slots[:: kv.block_size] // kv.block_size).tolist()
    plan = RequestPlan("r", tokens.tolist(), [blocks], load_from=4, load_to=15, retrieve_to=16)
    assert worker.load(plan) == 4
    assert worker.get_block_ids_with_load_errors() == set(blocks[1:4])
    assert engine.stats.get("errors") == 1
    engine.close()

