"""CacheBlendLM / LlamaBlendForward on a tiny random Llama (real HF code, no weights to load)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

from lmcache.blend.executor import CacheBlendImpl
from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.integration.transformers import CacheBlendLM, LlamaBlendForward, hf_engine_metadata
from lmcache.token_database import ChunkedTokenDatabase

SPT = [250, 251]


def segment(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, 240, (n - len(SPT),), generator=g), torch.tensor(SPT)])


def blender(model: Any, engine: LMCacheEngine, ratio: float) -> CacheBlendLM:
    return CacheBlendLM(model, engine, spt=SPT,
                        config=dataclasses.replace(engine.config, blend_recompute_ratio=ratio))


def plain_prefill(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=tokens.unsqueeze(0), past_key_values=cache, use_cache=True)
    return out.logits[0, -1], cache


@pytest.fixture
def rag_input(tiny_llama: Any, tiny_engine: LMCacheEngine) -> torch.Tensor:
    """Three precomputed segments in another order than stored, then an uncached 7-token query."""
    segs = [segment(1, 30), segment(2, 45), segment(3, 20)]
    b = blender(tiny_llama, tiny_engine, 0.0)
    assert [b.precompute(s) for s in segs] == [30, 45, 20]
    assert b.precompute(segs[0]) == 0  # already cached
    b.close()
    return torch.cat([segs[2], segs[0], segs[1], torch.tensor([5, 6, 7, 8, 9, 10, 11])])


def test_ratio_one_equals_plain_prefill(tiny_llama: Any, tiny_engine: LMCacheEngine,
                                        rag_input: torch.Tensor) -> None:
    b = blender(tiny_llama, tiny_engine, 1.0)
    out = b.prefill(rag_input)
    logits, cache = plain_prefill(tiny_llama, rag_input)
    assert out.blended and out.num_retrieved_tokens == 95 and out.num_recomputed_tokens == 102
    torch.testing.assert_close(out.logits, logits, atol=1e-5, rtol=1e-5)
    for got, ref in zip(out.past_key_values.layers, cache.layers):
        torch.testing.assert_close(got.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, ref.values, atol=1e-5, rtol=1e-5)
    b.close()


def test_ratio_zero_recomputes_only_the_query_and_reuses_moved_segment_kv(
        tiny_llama: Any, tiny_engine: LMCacheEngine, rag_input: torch.Tensor) -> None:
    b = blender(tiny_llama, tiny_engine, 0.0)
    out = b.prefill(rag_input)
    assert out.num_recomputed_tokens == 7  # the query after the last separator
    # the first segment sits where it was computed (positions 0..19): after the check layer its
    # blended KV is exactly the stored KV
    _, alone = plain_prefill(tiny_llama, rag_input[:20])
    last = tiny_llama.config.num_hidden_layers - 1
    torch.testing.assert_close(out.past_key_values.layers[last].keys[:, :, :20], alone.layers[last].keys,
                               atol=1e-5, rtol=1e-5)
    # the second segment moved from positions 0..29 to 20..49: its keys are re-rotated, so they
    # equal the stored keys rotated by +20, not the stored keys themselves
    _, seg0 = plain_prefill(tiny_llama, rag_input[20:50])
    moved = out.past_key_values.layers[last].keys[:, :, 20:50]
    assert not torch.allclose(moved, seg0.layers[last].keys, atol=1e-3)
    raw = b.forward.encode  # the model's own RoPE
    k_stored = seg0.layers[last].keys[0].transpose(0, 1).reshape(30, -1)
    _, k_back = b.executor.reverse_positional_encoder(torch.arange(30), k_stored[:, :0], k_stored)  # type: ignore[misc]
    _, k_new = raw(torch.arange(20, 50), k_back[:, :0], k_back)
    torch.testing.assert_close(moved[0].transpose(0, 1).reshape(30, -1), k_new, atol=1e-5, rtol=1e-5)
    b.close()


def test_generate_continues_from_the_blended_cache(tiny_llama: Any, tiny_engine: LMCacheEngine,
                                                   rag_input: torch.Tensor) -> None:
    b = blender(tiny_llama, tiny_engine, 1.0)
    got = b.generate(rag_input, max_new_tokens=6, do_sample=False)
    ref = tiny_llama.generate(rag_input.unsqueeze(0), attention_mask=torch.ones(1, rag_input.numel(),
                              dtype=torch.long), max_new_tokens=6, do_sample=False)
    assert torch.equal(got, ref)
    b.close()


def test_inputs_shorter_than_blend_min_tokens_are_simply_prefilled(tiny_llama: Any,
                                                                   tiny_engine: LMCacheEngine) -> None:
    b = blender(tiny_llama, tiny_engine, 0.0)
    short = segment(5, 7)  # blend_min_tokens=8
    out = b.prefill(short)
    assert not out.blended and out.num_recomputed_tokens == 7
    torch.testing.assert_close(out.logits, plain_prefill(tiny_llama, short)[0])
    b.close()


def test_query_mask_marks_the_tokens_after_the_last_separator(tiny_llama: Any,
                                                              tiny_engine: LMCacheEngine) -> None:
    b = blender(tiny_llama, tiny_engine, 0.0)
    tokens = torch.cat([segment(1, 10), torch.tensor([1, 2, 3])])
    assert b.query_mask(tokens).tolist() == [False] * 10 + [True] * 3
    assert not b.query_mask(segment(1, 10)).any()  # ends with the separator: no query
    b.close()


def test_blending_must_be_enabled_in_the_config(tiny_llama: Any, tiny_engine: LMCacheEngine) -> None:
    off = dataclasses.replace(tiny_engine.config, enable_blending=False)
    with pytest.raises(ValueError, match="enable_blending"):
        CacheBlendLM(tiny_llama, tiny_engine, spt=SPT, config=off)


def test_models_outside_the_llama_family_are_rejected() -> None:
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="normalises Q/K"):
        LlamaBlendForward(qwen3, CacheBlendImpl(0.1))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="not a Llama-family"):
        LlamaBlendForward(gpt2, CacheBlendImpl(0.1))


def test_hf_keys_equal_the_keys_of_a_vllm_engine_for_the_same_model_and_dtype(tiny_llama: Any) -> None:
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01)
    tokens = torch.arange(40)
    hf = hf_engine_metadata(tiny_llama, config)
    vllm = LMCacheEngineMetadata("tiny-llama-test", 1, 0, "vllm", torch.float32, (4, 2, 16, 2, 16))
    keys = [k for _, _, k in ChunkedTokenDatabase(config, hf).process_tokens(tokens)]
    assert keys == [k for _, _, k in ChunkedTokenDatabase(config, vllm).process_tokens(tokens)]
    bf16 = dataclasses.replace(vllm, kv_dtype=torch.bfloat16)
    assert keys[0] != ChunkedTokenDatabase(config, bf16).process_tokens(tokens)[0][2]


def test_generate_with_beam_search_continues_from_the_blended_cache(
        tiny_llama: Any, tiny_engine: LMCacheEngine, rag_input: torch.Tensor) -> None:
    b = blender(tiny_llama, tiny_engine, 1.0)
    got = b.generate(rag_input, max_new_tokens=4, num_beams=2, do_sample=False)
    ref = tiny_llama.generate(rag_input.unsqueeze(0), attention_mask=torch.ones(1, rag_input.numel(),
                              dtype=torch.long), max_new_tokens=4, num_beams=2, do_sample=False)
    assert torch.equal(got, ref)
    b.close()


def test_check_layers_beyond_the_models_layers_are_rejected(tiny_llama: Any,
                                                            tiny_engine: LMCacheEngine) -> None:
    config = dataclasses.replace(tiny_engine.config, blend_check_layers=[1, 4])
    with pytest.raises(ValueError, match=r"check layers \[4\] .* 4 layers"):
        CacheBlendLM(tiny_llama, tiny_engine, spt=SPT, config=config)


def test_forward_inputs_of_the_wrong_shape_are_rejected(tiny_llama: Any, tiny_engine: LMCacheEngine,
                                                        rag_input: torch.Tensor) -> None:
    b = blender(tiny_llama, tiny_engine, 0.0)
    n = rag_input.numel()
    task = b.retriever.new_request(rag_input, torch.tensor([0, n]))
    with pytest.raises(ValueError, match="input_ids must be"):
        b.forward(rag_input.unsqueeze(0), task)
    with pytest.raises(ValueError, match=f"force_recompute must be .* \\({n},\\)"):
        b.forward(rag_input, task, force_recompute=torch.zeros(n - 1, dtype=torch.bool))
    b.close()
