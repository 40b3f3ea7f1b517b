"""Scheduler-side planning of the vLLM connector, driven like vLLM's scheduler drives it."""

from types import SimpleNamespace

import pytest
import torch

from lmcache.config import LMCacheEngineConfig
from lmcache.integration.vllm.kv_groups import GroupKind, KVGroup, ModelKV
from lmcache.integration.vllm.lookup_channel import LookupServer, socket_path
from lmcache.integration.vllm.scheduler import LMCacheScheduler
from tests.helpers.vllm_config import instance_config

CHUNK, BLOCK = 256, 128
ONE_GROUP = ModelKV("llama", (KVGroup(0, GroupKind.FULL, BLOCK, ("l.0",)),), 2, 64, torch.float32)


class FakeRequest:
    def __init__(self, rid, prompt_len):
        self.request_id = rid
        self.prompt_token_ids = list(range(prompt_len))
        self.num_prompt_tokens = prompt_len
        self.all_token_ids = list(self.prompt_token_ids)
        self.cache_salt = None
        self.lora_request = None


TWO_GROUPS = ModelKV("gpt_oss", (KVGroup(0, GroupKind.SLIDING, BLOCK, ("l.0",), window=128),
                                  KVGroup(1, GroupKind.FULL, BLOCK, ("l.1",))), 2, 64, torch.float32)


class Blocks:
    """vLLM's KVCacheBlocks: `ids` of one group, or a tuple of lists (one per group)."""

    def __init__(self, ids):
        self.ids = ids if isinstance(ids, tuple) else (ids,)

    def get_block_ids(self):
        return self.ids


def _groups(b):
    return b if isinstance(b, tuple) else (b,)


def step(new=(), cached=(), scheduled=None, resumed=()):
    """A SchedulerOutput with the fields the connector reads (block ids: one group's list, or a
    tuple of lists, one per group)."""
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=_groups(b), num_computed_tokens=c) for r, b, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[None if b is None else _groups(b) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=scheduled or {},
    )


@pytest.fixture
def make_scheduler():
    servers = []

    def make(hit=0, role="kv_both", model=ONE_GROUP, **cfg):
        vllm_config = instance_config(kv_role=role)
        servers.append(LookupServer(socket_path(vllm_config, 0), lambda h, t: {"hit": hit}))
        return LMCacheScheduler(vllm_config, LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, **cfg),
                                model)

    yield make
    for s in servers:
        s.close()


def test_chunked_prefill_saves_each_completed_chunk_then_the_tail(make_scheduler):
    sched = make_scheduler(hit=0)
    req = FakeRequest("a", 700)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, Blocks([5, 6, 7]), 0)
    m1 = sched.build_connector_meta(step(new=[("a", [5, 6, 7], 0)], scheduled={"a": 300}))
    assert [(p.save_from, p.save_to, p.has_load) for p in m1.requests] == [(0, 256, False)]
    assert m1.requests[0].token_ids == req.prompt_token_ids[:256]
    m2 = sched.build_connector_meta(step(cached=[("a", [8, 9], 300)], scheduled={"a": 300}))
    assert [(p.save_from, p.save_to) for p in m2.requests] == [(256, 512)]
    assert m2.requests[0].block_ids == [[5, 6, 7, 8, 9]]
    m3 = sched.build_connector_meta(step(cached=[("a", None, 600)], scheduled={"a": 100}))
    assert [(p.save_from, p.save_to) for p in m3.requests] == [(512, 700)]
    req.all_token_ids.append(42)
    m4 = sched.build_connector_meta(step(cached=[("a", None, 700)], scheduled={"a": 1}))
    assert m4.requests == []  # decode tokens are not saved by default
    assert sched.request_finished(req) == {"lmcache_loaded_tokens": 0}


def test_lookup_hit_becomes_a_load_beyond_vllms_own_hit_leaving_one_token(make_scheduler):
    sched = make_scheduler(hit=700)
    req = FakeRequest("b", 700)
    assert sched.get_num_new_matched_tokens(req, 128) == (699 - 128, False)
    assert sched.get_num_new_matched_tokens(req, 128) == (699 - 128, False)  # repeatable
    sched.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5, 6]), 699 - 128)
    (plan,) = sched.build_connector_meta(
        step(new=[("b", [1, 2, 3, 4, 5, 6], 699)], scheduled={"b": 1})
    ).requests
    assert (plan.load_from, plan.load_to, plan.retrieve_to) == (128, 699, 700)
    assert plan.save_to <= plan.save_from  # everything is cached already
    assert len(plan.token_ids) == 700
    (again,) = sched.build_connector_meta(step(cached=[("b", None, 700)], scheduled={"b": 1})).requests or [
        None
    ]
    assert again is None or not again.has_load  # a load is planned once
    assert sched.request_finished(req) == {"lmcache_loaded_tokens": 571}


def test_hit_not_beyond_vllms_own_cache_loads_nothing(make_scheduler):
    sched = make_scheduler(hit=256)
    assert sched.get_num_new_matched_tokens(FakeRequest("c", 600), 384) == (0, False)


def test_roles(make_scheduler):
    producer = make_scheduler(hit=512, role="kv_producer")
    req = FakeRequest("p", 600)
    assert producer.get_num_new_matched_tokens(req, 0) == (0, False)
    producer.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), 0)
    (plan,) = producer.build_connector_meta(
        step(new=[("p", [1, 2, 3, 4, 5], 0)], scheduled={"p": 600})
    ).requests
    assert plan.has_save and not plan.has_load
    consumer = make_scheduler(hit=512, role="kv_consumer")
    req = FakeRequest("q", 600)
    n, _ = consumer.get_num_new_matched_tokens(req, 0)
    consumer.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), n)
    (plan,) = consumer.build_connector_meta(
        step(new=[("q", [1, 2, 3, 4, 5], n)], scheduled={"q": 600 - n})
    ).requests
    assert plan.has_load and not plan.has_save


def test_decode_tokens_are_saved_with_save_decode_cache(make_scheduler):
    sched = make_scheduler(hit=0, save_decode_cache=True)
    req = FakeRequest("d", 500)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, Blocks([1, 2, 3, 4]), 0)
    (p1,) = sched.build_connector_meta(step(new=[("d", [1, 2, 3, 4], 0)], scheduled={"d": 500})).requests
    assert (p1.save_from, p1.save_to) == (0, 500)
    req.all_token_ids += list(range(20))
    assert sched.build_connector_meta(step(cached=[("d", None, 500)], scheduled={"d": 1})).requests == []
    (p2,) = sched.build_connector_meta(step(cached=[("d", None, 511)], scheduled={"d": 1})).requests
    assert (p2.save_from, p2.save_to) == (500, 512)


def test_several_groups_load_asynchronously_before_the_request_computes(make_scheduler):
    """vLLM recovers failed loads of several KV cache groups only by request: the load is planned
    in the step that admits the request (which does not compute yet) and reported as finished."""
    sched = make_scheduler(hit=700, model=TWO_GROUPS)
    req = FakeRequest("h", 700)
    assert sched.get_num_new_matched_tokens(req, 0) == (699, True)
    sched.update_state_after_alloc(req, Blocks(([0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12])), 699)
    (load,) = sched.build_connector_meta(step()).requests  # the request is not scheduled yet
    assert load.load_async and (load.load_from, load.load_to, load.retrieve_to) == (0, 699, 700)
    assert load.block_ids == [[0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    assert not load.has_save
    # the load finished: vLLM allocates the rest and schedules the request's last token
    sched.update_state_after_alloc(req, Blocks(([0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12])), 0)
    assert sched.build_connector_meta(step(new=[("h", ([0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12]), 699)],
                                           scheduled={"h": 1})).requests == []  # nothing left to save
    assert sched.request_finished(req) == {"lmcache_loaded_tokens": 699}


def test_a_failed_asynchronous_load_is_not_offered_again(make_scheduler):
    sched = make_scheduler(hit=512, model=TWO_GROUPS)
    req = FakeRequest("f", 600)
    n, is_async = sched.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (512, True)
    sched.update_state_after_alloc(req, Blocks(([1, 2, 3, 4], [5, 6, 7, 8])), n)
    sched.build_connector_meta(step())
    sched.loads_failed({"f"})  # vLLM resets the request to recompute it from scratch
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, Blocks(([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])), 0)
    (plan,) = sched.build_connector_meta(step(new=[("f", ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), 0)],
                                              scheduled={"f": 600})).requests
    assert not plan.has_load and (plan.save_from, plan.save_to) == (0, 600)  # it saves all of it anew
    assert sched.request_finished(req) == {"lmcache_loaded_tokens": 0}


def test_each_group_keeps_its_own_block_table_through_steps_and_preemption(make_scheduler):
    sched = make_scheduler(hit=0, model=TWO_GROUPS)
    req = FakeRequest("g", 1000)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, Blocks(([1, 2, 3, 4], [5, 6, 7, 8])), 0)
    sched.build_connector_meta(step(new=[("g", ([1, 2, 3, 4], [5, 6, 7, 8]), 0)], scheduled={"g": 512}))
    (p2,) = sched.build_connector_meta(step(cached=[("g", ([9], [10]), 512)], scheduled={"g": 256})).requests
    assert p2.block_ids == [[1, 2, 3, 4, 9], [5, 6, 7, 8, 10]] and (p2.save_from, p2.save_to) == (512, 768)
    # preempted, then resumed with new blocks in every group: the tables are replaced
    tables = (list(range(20, 28)), list(range(30, 38)))
    (p3,) = sched.build_connector_meta(step(cached=[("g", tables, 0)], scheduled={"g": 1000},
                                            resumed=["g"])).requests
    assert p3.block_ids == list(tables)
    assert (p3.save_from, p3.save_to) == (768, 1000)  # what was saved before stays saved


HYBRID = ModelKV("qwen3_next", (KVGroup(0, GroupKind.STATE, CHUNK, ("l.0",), state="s"),
                                KVGroup(1, GroupKind.FULL, CHUNK, ("l.1",))), 2, 64, torch.bfloat16)


def test_a_hybrid_model_saves_its_state_where_a_prefill_step_ends_on_a_chunk_boundary(make_scheduler):
    sched = make_scheduler(hit=0, model=HYBRID)
    req = FakeRequest("s", 900)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, Blocks(([0, 1], [2, 3])), 0)
    (p1,) = sched.build_connector_meta(step(new=[("s", ([0, 1], [2, 3]), 0)], scheduled={"s": 512})).requests
    assert (p1.save_from, p1.save_to, p1.save_state_at) == (0, 512, 512)
    (p2,) = sched.build_connector_meta(step(cached=[("s", ([4], [5]), 512)], scheduled={"s": 256})).requests
    assert (p2.save_from, p2.save_to, p2.save_state_at) == (512, 768, 768)
    (p3,) = sched.build_connector_meta(step(cached=[("s", ([6], [7]), 768)], scheduled={"s": 132})).requests
    assert (p3.save_from, p3.save_to, p3.save_state_at) == (768, 900, 0)  # 900 is no boundary
    assert len(p3.token_ids) == 900
    req.all_token_ids += list(range(124))
    for computed in range(901, 1024):
        sched.build_connector_meta(step(cached=[("s", None, computed - 1)], scheduled={"s": 1}))
    assert sched.build_connector_meta(step(cached=[("s", None, 1023)], scheduled={"s": 1})).requests == []


def test_a_preempted_request_readmitted_with_a_hit_gets_its_load(make_scheduler):
    """vLLM frees a preempted request's blocks and admits it again: a hit LMCache answers then must
    be loaded into its new blocks (vLLM counts those tokens as computed)."""
    sched = make_scheduler(hit=512)
    req = FakeRequest("p", 700)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5, 6]), 512)
    blocks = [1, 2, 3, 4, 5, 6]
    (first,) = sched.build_connector_meta(step(new=[("p", blocks, 512)], scheduled={"p": 188})).requests
    assert first.has_load
    # preempted; admitted again with the same hit, into other blocks
    assert sched.get_num_new_matched_tokens(req, 0) == (512, False)
    sched.update_state_after_alloc(req, Blocks([7, 8, 9, 10, 11, 12]), 512)
    new_blocks = [7, 8, 9, 10, 11, 12]
    (again,) = sched.build_connector_meta(step(cached=[("p", new_blocks, 512)], scheduled={"p": 188},
                                               resumed=["p"])).requests
    assert (again.load_from, again.load_to) == (0, 512) and again.block_ids == [[7, 8, 9, 10, 11, 12]]
    assert not again.has_save or again.save_from >= 512  # what was saved before stays saved


def test_a_model_of_sliding_windows_only_loads_asynchronously(make_scheduler):
    """One sliding-window group: a hit's blocks before the window are vLLM's null block. A failed
    synchronous load makes vLLM recompute from the first failed block, whose window reaches into
    those null blocks (garbage); a failed asynchronous one is recomputed from the first token."""
    sliding = ModelKV("mistral", (KVGroup(0, GroupKind.SLIDING, BLOCK, ("l.0",), window=128),), 2, 64,
                      torch.float32)
    sched = make_scheduler(hit=700, model=sliding)
    assert sched.get_num_new_matched_tokens(FakeRequest("w", 700), 0) == (699, True)
