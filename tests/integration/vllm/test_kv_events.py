"""A vLLM-CPU engine with ``--kv-events-config`` publishes LMCache's tiers in vLLM's KV events: a
subscriber decoding with vLLM's own `KVEventBatch` reads every batch, and the prefix the events
say each tier holds is what the engine's lookup reports, after evictions from a small hot tier
and after a clear (with the next engine step)."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.helpers.kv_events import Subscriber
from tests.helpers.servers import free_port
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text, start_llm, stop_llm

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

def _post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _agree(sub: Subscriber, port: int, prompts: list[list[int]], bs: int, timeout: float = 1.0) -> None:
    """Within `timeout` s the events' view of each tier equals the engine's lookup, per prompt."""
    deadline = time.monotonic() + timeout
    while True:
        want, got = [], []
        for tokens in prompts:
            tiers = _post(port, "/lookup", {"tokens": tokens})["tiers"]
            want.append((tiers["Hot"] // bs * bs, tiers["LocalDiskBackend"] // bs * bs))
            got.append((sub.prefix(tokens, "CPU", bs), sub.prefix(tokens, "STORAGE", bs)))
        if want == got:
            return
        assert time.monotonic() < deadline, f"events say {got}, lookup says {want}"
        time.sleep(0.05)


def test_lmcache_tiers_in_vllm_kv_events_match_lookup_through_eviction_and_clear(tmp_path):
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig

    sub = Subscriber()
    port = free_port()
    # a chunk of SmolLM2 in fp32 is ~11.8 MB: the hot tier keeps 4 of the 9 chunks, the disk all
    transfer = lmcache_transfer_config(chunk_size=256, max_local_cpu_size=0.05,
                                       local_disk=str(tmp_path / "disk"), max_local_disk_size=1.0,
                                       controller_url=f"127.0.0.1:{port}")
    llm = start_llm(transfer, kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                               endpoint=sub.endpoint))
    try:
        bs = llm.llm_engine.vllm_config.cache_config.block_size
        tok = llm.get_tokenizer()
        prompts = [tok.encode(sentence_text(seed, 520))[:600] for seed in (71, 72, 73)]
        once = SamplingParams(max_tokens=1, temperature=0.0)
        for tokens in prompts:
            llm.generate({"prompt_token_ids": tokens}, once, use_tqdm=False)
        time.sleep(1.0)  # the disk's writes end in the background: their events leave with a step
        llm.generate({"prompt_token_ids": [1, 2, 3]}, once, use_tqdm=False)
        _agree(sub, port, prompts, bs)
        assert sub.prefix(prompts[0], "CPU", bs) == 0 < sub.prefix(prompts[0], "STORAGE", bs)  # evicted
        # 600 tokens: the trailing partial block is not reported (vLLM hashes whole blocks only)
        assert sub.prefix(prompts[-1], "CPU", bs) == 512

        assert _post(port, "/clear", {"tier": "hot"})["cleared"]["Hot"] > 0
        llm.generate({"prompt_token_ids": [4, 5, 6]}, once, use_tqdm=False)
        _agree(sub, port, prompts, bs)
        assert all(sub.prefix(t, "CPU", bs) == 0 and sub.prefix(t, "STORAGE", bs) == 512 for t in prompts)
        with sub.lock:
            assert sub.undecodable == 0 and sub.seqs == list(range(len(sub.seqs)))
    finally:
        stop_llm(llm, wait=False)
        sub.close()
