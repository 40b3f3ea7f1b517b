"""CacheBlendLM with the real SmolLM2: passages precomputed alone, reused in another order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from lmcache.cache_engine import LMCacheEngine
from lmcache.integration.transformers import CacheBlendLM

pytestmark = pytest.mark.integration

PASSAGES = [
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my "
    "purse, and nothing particular to interest me on shore, I thought I would sail about a little and "
    "see the watery part of the world. It is a way I have of driving off the spleen and regulating the "
    "circulation.",
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing "
    "to do: once or twice she had peeped into the book her sister was reading, but it had no pictures "
    "or conversations in it, \"and what is the use of a book,\" thought Alice \"without pictures or "
    "conversations?\"",
    "Marley was dead: to begin with. There is no doubt whatever about that. The register of his burial "
    "was signed by the clergyman, the clerk, the undertaker, and the chief mourner. Scrooge signed it: "
    "and Scrooge's name was good upon 'Change, for anything he chose to put his hand to.",
]
QUESTION = "\nQuestion: What was Alice's sister reading?\nAnswer:"


ANSWER = " Alice's sister was reading a book with no pictures or conversations in it."


def answer_logprobs(model: Any, logits: torch.Tensor, cache: DynamicCache,
                    answer: torch.Tensor) -> torch.Tensor:
    """``[len(answer), vocab]`` log-probs of each answer token, teacher-forced after the input."""
    with torch.inference_mode():
        rest = model(input_ids=answer[:-1].unsqueeze(0), past_key_values=cache, use_cache=True).logits[0]
    return torch.log_softmax(torch.cat([logits.unsqueeze(0), rest]).float(), dim=-1)


def mean_kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((ref.exp() * (ref - got)).sum(-1).mean())


@pytest.fixture
def setup(smollm: tuple[Any, Any], make_engine: Callable[..., LMCacheEngine]) -> tuple[Any, LMCacheEngine]:
    engine = make_engine(enable_blending=True, blend_min_tokens=32)
    blender = CacheBlendLM(smollm[0], engine, tokenizer=smollm[1])
    for text in PASSAGES:  # each passage's KV precomputed alone, in the original order
        assert blender.precompute(blender.encode_segment(text)) > 0
    blender.close()
    return smollm, engine


def blend_at(smollm: tuple[Any, Any], engine: LMCacheEngine, ratio: float) -> CacheBlendLM:
    return CacheBlendLM(smollm[0], engine, tokenizer=smollm[1],
                        config=dataclasses.replace(engine.config, blend_recompute_ratio=ratio))


def full_prefill(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = model(input_ids=ids.unsqueeze(0), past_key_values=cache, use_cache=True).logits[0, -1]
    return logits, cache


def test_blend_with_ratio_one_matches_full_prefill(setup: tuple[Any, LMCacheEngine]) -> None:
    smollm, engine = setup
    b = blend_at(smollm, engine, 1.0)
    ids = b.build_input(PASSAGES[::-1], QUESTION)
    out = b.prefill(ids)
    assert out.blended and out.num_recomputed_tokens == ids.numel()
    torch.testing.assert_close(out.logits, full_prefill(smollm[0], ids)[0], atol=1e-4, rtol=1e-4)
    b.close()


def test_cached_passages_in_a_different_order_are_reused_with_few_tokens_recomputed(
        setup: tuple[Any, LMCacheEngine]) -> None:
    smollm, engine = setup
    model, tok = smollm
    blenders = {r: blend_at(smollm, engine, r) for r in (0.0, 0.15)}
    ids = blenders[0.0].build_input([PASSAGES[2], PASSAGES[0], PASSAGES[1]], QUESTION)
    segments = sum(blenders[0.0].encode_segment(p).numel() for p in PASSAGES)
    query = ids.numel() - segments
    zero, blended = blenders[0.0].prefill(ids), blenders[0.15].prefill(ids)
    assert zero.num_retrieved_tokens == blended.num_retrieved_tokens == segments
    assert zero.num_recomputed_tokens == query
    assert blended.num_recomputed_tokens == query + -(-segments * 15 // 100)  # ceil(0.15 * segments)

    answer = torch.tensor(tok(ANSWER, add_special_tokens=False)["input_ids"])
    ref = answer_logprobs(model, *full_prefill(model, ids), answer)
    question_only = answer_logprobs(model, *full_prefill(model, ids[segments:]), answer)
    kl_zero = mean_kl(ref, answer_logprobs(model, zero.logits, zero.past_key_values, answer))
    kl_blend = mean_kl(ref, answer_logprobs(model, blended.logits, blended.past_key_values, answer))
    # the passages' reused KV carries their content (dropping them costs ~1.5 nats per token) and
    # recomputing 15% of it brings the distributions closer to full prefill
    assert kl_blend < kl_zero < 0.2 * mean_kl(ref, question_only)

    # moving the reused keys to their new positions matters: without the RoPE correction it is worse
    unmoved = blend_at(smollm, engine, 0.15)
    unmoved.executor.positional_encoder = unmoved.executor.reverse_positional_encoder = None
    out = unmoved.prefill(ids)
    assert mean_kl(ref, answer_logprobs(model, out.logits, out.past_key_values, answer)) > 2 * kl_blend

    text = tok.decode(blenders[0.15].generate(ids, max_new_tokens=8, do_sample=False)[0, ids.numel():])
    assert text.strip()
    for b in (*blenders.values(), unmoved):
        b.close()
