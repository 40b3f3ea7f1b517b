"""Two vLLM-CPU instances sharing KV peer to peer (only a Valkey lookup service in common)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from lmcache.integration.vllm.lookup_channel import LookupClient, socket_path
from tests.helpers.servers import Valkey
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text, start_llms, stop_llm

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

DOC = sentence_text(11, 420) + " Question: what did the committee count?"


def greedy(llm, prompt):
    from vllm import SamplingParams

    (out,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    return out


def test_an_instance_loads_a_document_another_instance_served(tmp_path):
    """The reference is `a`'s first answer: a full prefill (nothing cached, nothing loaded), which
    equals the engine without a connector (`test_connector.py`, `test_architectures.py`)."""
    valkey = Valkey(tmp_path).start()
    p2p = {"enable_p2p": True, "lookup_url": f"127.0.0.1:{valkey.port}", "distributed_url": "127.0.0.1:0",
           "max_local_cpu_size": 0.25}
    b_transfer = lmcache_transfer_config(**p2p, clear_hot_on_reset=True)
    try:
        a, b = start_llms({"kv_transfer_config": lmcache_transfer_config(**p2p)},
                          {"kv_transfer_config": b_transfer})
    except BaseException:
        valkey.kill()
        raise
    try:
        first = greedy(a, DOC)
        assert first.num_cached_tokens == 0 and first.kv_transfer_params["lmcache_loaded_tokens"] == 0
        expected = first.outputs[0].text

        pulled = greedy(b, DOC)  # b never saw the document: its KV comes from a
        assert pulled.outputs[0].text == expected
        assert pulled.kv_transfer_params["lmcache_loaded_tokens"] >= 256
        assert pulled.num_cached_tokens == pulled.kv_transfer_params["lmcache_loaded_tokens"]

        client = LookupClient([socket_path(b.llm_engine.vllm_config, 0)], timeout=10)
        (stats,) = client.stats()
        assert stats is not None and stats["engine"]["retrieve_hit_tokens"] >= 256
        assert stats["tiers"]["Hot"]["gauges"]["chunks"] > 0  # what b pulled (and computed) is now b's too

        # vLLM's reset of connector caches too (HTTP: /reset_prefix_cache?reset_external=true); with
        # clear_hot_on_reset, b's own copies go, a still has them
        assert b.reset_prefix_cache(reset_connector=True)
        (stats,) = client.stats()
        assert stats is not None and stats["tiers"]["Hot"]["gauges"]["chunks"] == 0
        again = greedy(b, DOC)
        assert again.outputs[0].text == expected and again.kv_transfer_params["lmcache_loaded_tokens"] >= 256
        client.close()
    finally:
        for llm in (b, a):
            stop_llm(llm, wait=False)
        valkey.kill()
