"""`PrefixCacheLM` through each copy path of its token-major connector: the CPU default, the staged
path forced on the CPU (``LMCACHE_STAGED_COPY=1``) and CUDA (where present). A repeat loads exactly
the KV the first prefill stored and computes only the last token. Also: generation options that
widen the batch work on a hit as on a miss, a model of another dtype is refused, and a cache that
holds only a sliding window is not stored (a miss, not an error)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import GenerationConfig, MistralConfig, MistralForCausalLM

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.transformers import PrefixCacheLM, create_hf_engine


@pytest.mark.parametrize("mode", ["cpu", "cpu-staged", "cuda"])
def test_a_repeat_loads_the_stored_kv_bit_for_bit(tiny_llama: Any, mode: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("LMCACHE_STAGED_COPY", "1" if mode == "cpu-staged" else "0")
    model = tiny_llama if mode != "cuda" else copy.deepcopy(tiny_llama).to("cuda", torch.bfloat16)
    instance = f"paths-{mode}"
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01)
    engine = create_hf_engine(model, config, instance_id=instance)
    try:
        assert engine.gpu_connector.staged == (mode == "cpu-staged")  # type: ignore[attr-defined]
        lm = PrefixCacheLM(model, engine)
        ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))
        first = lm.prefill(ids)
        assert (first.num_cached_tokens, first.num_computed_tokens) == (0, 70)
        assert engine.gpu_connector.drain(30)  # type: ignore[attr-defined]
        second = lm.prefill(ids)
        assert (second.num_cached_tokens, second.num_computed_tokens) == (69, 1)
        for a, b in zip(first.past_key_values.layers, second.past_key_values.layers):
            assert torch.equal(a.keys[:, :, :69], b.keys[:, :, :69])  # type: ignore[index]
            assert torch.equal(a.values[:, :, :69], b.values[:, :, :69])  # type: ignore[index]
        tol = 1e-4 if mode != "cuda" else 5e-2
        torch.testing.assert_close(second.logits.float(), first.logits.float(), atol=tol, rtol=tol)
    finally:
        LMCacheEngineBuilder.destroy(instance)


def test_two_engines_on_a_cache_server_share_a_prefill(tiny_llama: Any, tmp_path: Any) -> None:
    """The HF integration on a cache server (`cache_server_url`): a prefill one engine stored is
    loaded bit for bit by another engine that never saw it."""
    import threading

    from lmcache.cache_server.server import CacheServer

    url = f"ipc://{tmp_path}/cache.sock"
    server = CacheServer(url, 16 << 20)
    loop = threading.Thread(target=server.serve_forever)
    loop.start()
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, cache_server_url=url)
    try:
        one = PrefixCacheLM(tiny_llama, create_hf_engine(tiny_llama, config, instance_id="server-one"))
        two = PrefixCacheLM(tiny_llama, create_hf_engine(tiny_llama, config, instance_id="server-two"))
        ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(2))
        first = one.prefill(ids)
        assert (first.num_cached_tokens, first.num_computed_tokens) == (0, 70)
        assert one.engine.gpu_connector.drain(30)  # type: ignore[attr-defined]
        # The commit is a one-way message: engine one's next request, on the same socket, is
        # answered after it; engine two's, on its own socket, might have been answered before.
        assert one.engine.lookup(ids[0]) == 70
        second = two.prefill(ids)
        assert (second.num_cached_tokens, second.num_computed_tokens) == (69, 1)
        for a, b in zip(first.past_key_values.layers, second.past_key_values.layers):
            assert torch.equal(a.keys[:, :, :69], b.keys[:, :, :69])  # type: ignore[index]
            assert torch.equal(a.values[:, :, :69], b.values[:, :, :69])  # type: ignore[index]
        torch.testing.assert_close(second.logits, first.logits, atol=1e-4, rtol=1e-4)
        assert server.stats()["arena"]["used_bytes"] > 0
    finally:
        LMCacheEngineBuilder.destroy("server-one")
        LMCacheEngineBuilder.destroy("server-two")
        server.stop()
        loop.join()
        server.close()


@pytest.mark.parametrize("options", [
    {"num_beams": 2},
    {"num_beams": 3, "num_return_sequences": 2},
    {"generation_config": GenerationConfig(num_beams=2, max_new_tokens=5, do_sample=False)},
], ids=["beams", "beams-and-sequences", "generation-config"])
def test_generation_options_that_widen_the_batch_give_the_same_output_on_a_hit(
        tiny_llama: Any, tiny_engine: LMCacheEngine, options: dict[str, Any]) -> None:
    lm = PrefixCacheLM(tiny_llama, tiny_engine)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    kwargs = {"max_new_tokens": 5, "do_sample": False, **options} if "generation_config" not in options \
        else options
    ref = tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert torch.equal(lm.generate(ids, **kwargs), ref)  # a miss: stores the prompt
    assert tiny_engine.lookup(ids[0]) == 40
    assert torch.equal(lm.generate(ids, **kwargs), ref)  # a hit


def test_a_model_of_another_dtype_than_the_engines_kv_is_rejected(tiny_llama: Any,
                                                                  tiny_engine: LMCacheEngine) -> None:
    with pytest.raises(ValueError, match=r"KV dtype torch.float32 .* model's dtype torch.bfloat16"):
        PrefixCacheLM(copy.deepcopy(tiny_llama).to(torch.bfloat16), tiny_engine)


def test_a_prompt_longer_than_a_sliding_window_is_a_cache_miss_not_an_error() -> None:
    """A sliding-window layer keeps only its last tokens' KV: such a prompt is computed and not
    stored; one within the window is stored and reused as usual."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, sliding_window=16)).eval()
    model.config.name_or_path = "tiny-mistral-test"
    config = LMCacheEngineConfig.from_defaults(chunk_size=8, max_local_cpu_size=0.01)
    engine = create_hf_engine(model, config, instance_id="paths-sliding")
    try:
        lm = PrefixCacheLM(model, engine)
        for n, stored in ((40, 0), (12, 12)):
            ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n))
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
            assert torch.equal(lm.generate(ids, max_new_tokens=4, do_sample=False), ref)
            assert engine.lookup(ids[0]) == stored
            assert torch.equal(lm.generate(ids, max_new_tokens=4, do_sample=False), ref)
            assert lm.prefill(ids).num_cached_tokens == min(stored, n - 1)
    finally:
        LMCacheEngineBuilder.destroy("paths-sliding")
