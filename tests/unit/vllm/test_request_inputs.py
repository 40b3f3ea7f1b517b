"""What names a request's KV: the same token ids are not the same input when the prompt carries
images or embeddings. Driven like vLLM drives the connector, over a real engine behind the real
lookup channel."""

from types import SimpleNamespace

import pytest
import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

from lmcache.integration.vllm.kv_groups import GroupKind, KVGroup, ModelKV
from lmcache.integration.vllm.lookup_channel import LookupServer, socket_path
from lmcache.integration.vllm.scheduler import LMCacheScheduler
from tests.helpers.paged_kv import PagedKV, build_engine
from tests.helpers.vllm_config import instance_config
from tests.unit.vllm.test_worker_faults import worker_over

CHUNK = 8
PROMPT = list(range(100, 124))  # 3 chunks; tokens 4..11 stand for an image


class Request:
    def __init__(self, rid, images=(), prompt_embeds=None):
        self.request_id = rid
        self.prompt_token_ids = list(PROMPT)
        self.num_prompt_tokens = len(PROMPT)
        self.all_token_ids = list(PROMPT)
        self.cache_salt = None
        self.lora_request = None
        self.prompt_embeds = prompt_embeds
        self.mm_features = [MultiModalFeatureSpec(None, "image", image, PlaceholderRange(4, 8))
                            for image in images]


@pytest.fixture
def instance():
    """A scheduler side and a worker side over one engine, as one vLLM instance has them."""
    engine = build_engine(CHUNK, error_handling=True)
    kv = PagedKV()
    worker = worker_over(engine, kv)
    model = ModelKV("llama", (KVGroup(0, GroupKind.FULL, kv.block_size, ("l.0",)),), kv.heads,
                    kv.head_size, kv.dtype)
    vllm_config = instance_config()
    server = LookupServer(socket_path(vllm_config, 0), worker._answer)
    scheduler = LMCacheScheduler(vllm_config, engine.config, model)
    yield SimpleNamespace(engine=engine, kv=kv, worker=worker, scheduler=scheduler)
    scheduler.close()
    server.close()
    engine.close()


def serve(instance, request):
    """Admit `request`, run its whole prompt in one step and save what the plan says; the tokens
    the connector offered to load."""
    sched, kv = instance.scheduler, instance.kv
    hit, _ = sched.get_num_new_matched_tokens(request, 0)
    blocks = (kv.slots_for(len(PROMPT))[:: kv.block_size] // kv.block_size).tolist()
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), hit)
    step = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=request.request_id, block_ids=(blocks,),
                                            num_computed_tokens=hit)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={request.request_id: len(PROMPT) - hit})
    for plan in sched.build_connector_meta(step).requests:
        if plan.has_save:
            instance.worker.save(plan)
    sched.request_finished(request)
    return hit


def test_the_same_text_with_another_image_is_not_a_hit(instance):
    assert serve(instance, Request("a", images=["image-A"])) == 0
    assert serve(instance, Request("b", images=["image-B"])) == 0  # the image's KV differs
    assert instance.engine.lookup(torch.tensor(PROMPT)) == 0  # nor is it the bare tokens' KV
    assert serve(instance, Request("c", images=["image-A"])) == len(PROMPT) - 1  # the same image hits


def test_a_prompt_of_embeddings_is_neither_loaded_nor_stored(instance):
    """vLLM's token ids of a prompt given as embeddings are placeholders: they name no KV."""
    assert serve(instance, Request("a", prompt_embeds=torch.ones(len(PROMPT), 4))) == 0
    assert serve(instance, Request("b", prompt_embeds=torch.zeros(len(PROMPT), 4))) == 0
    assert instance.engine.lookup(torch.tensor(PROMPT)) == 0
