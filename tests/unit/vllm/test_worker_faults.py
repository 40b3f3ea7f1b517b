"""The worker side never lets a cache fault reach vLLM: failed loads become recompute requests."""

from types import SimpleNamespace

import torch

from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.integration.vllm.metadata import RequestPlan
from lmcache.integration.vllm.worker import LMCacheWorker
from tests.helpers.paged_kv import PagedKV, build_engine


class BrokenConnector(VLLMPagedMemGPUConnectorV2):
    def batched_from_gpu(self, *args, **kwargs):
        raise RuntimeError("injected save failure")

    def batched_to_gpu(self, *args, **kwargs):
        raise RuntimeError("injected load failure")


def worker_over(engine, kv):
    worker = LMCacheWorker(SimpleNamespace(cache_config=SimpleNamespace(block_size=kv.block_size)),
                           engine.config, rank=0)
    worker.engine, worker.kvcaches = engine, kv.layers
    return worker


def test_a_failing_load_reports_its_blocks_for_recompute_and_does_not_raise():
    engine = build_engine(8, error_handling=False)  # errors propagate out of the engine itself
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    slots = kv.slots_for(16)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    engine.gpu_connector = BrokenConnector(8, 2)
    worker = worker_over(engine, kv)
    blocks = (slots[:: kv.block_size] // kv.block_size).tolist()
    plan = RequestPlan("r", tokens.tolist(), blocks, load_from=4, load_to=15, retrieve_to=16)
    assert worker.load(plan) == 4
    assert worker.get_block_ids_with_load_errors() == set(blocks[1:4])
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    engine.close()


def test_a_failing_save_is_logged_not_raised():
    engine = build_engine(8, error_handling=False)
    engine.gpu_connector = BrokenConnector(8, 2)
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    blocks = (kv.slots_for(16)[:: kv.block_size] // kv.block_size).tolist()
    worker_over(engine, kv).save(RequestPlan("s", tokens.tolist(), blocks, save_from=0, save_to=16))
    assert engine.lookup(tokens) == 0
    engine.close()
