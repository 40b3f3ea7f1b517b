"""PrefixCacheLM with the real SmolLM2: exact reuse, and the model computes only what is not cached."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.transformers import PrefixCacheLM, hf_engine_metadata
from lmcache.token_database import ChunkedTokenDatabase

from .conftest import ForwardTokenCounter

pytestmark = pytest.mark.integration

PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
          "must be in want of a wife. However little known the feelings or views of such a man may be "
          "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
          "surrounding families, that he is considered the rightful property of some one or other of "
          "their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard that "
          "Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But it is,\" returned "
          "she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made no "
          "answer. \"Do you not want to know who has taken it?\" cried his wife impatiently.")
MORE = " \"You want to tell me, and I have no objection to hearing it.\" This was invitation enough."


def ids_of(tok: Any, text: str) -> torch.Tensor:
    return tok(text, return_tensors="pt").input_ids


def plain_generate(model: Any, ids: torch.Tensor, n: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)


def test_greedy_output_is_identical_and_the_second_call_computes_only_the_uncached_suffix(
        smollm: tuple[Any, Any], make_engine: Callable[..., LMCacheEngine],
        forward_tokens: ForwardTokenCounter) -> None:
    model, tok = smollm
    lm = PrefixCacheLM(model, make_engine())
    ids = ids_of(tok, PROMPT)
    t = ids.shape[1]
    ref = plain_generate(model, ids, 12)
    forward_tokens.take()

    assert torch.equal(lm.generate(ids, max_new_tokens=12, do_sample=False), ref)
    assert forward_tokens.take() == [t] + [1] * 11  # nothing cached yet: the whole prompt

    assert torch.equal(lm.generate(ids, max_new_tokens=12, do_sample=False), ref)
    assert forward_tokens.take() == [1] * 12  # whole prompt cached: only the last token is recomputed

    longer = ids_of(tok, PROMPT + MORE)
    assert torch.equal(longer[0, :t - 1], ids[0, : t - 1])  # same prefix (the last token may re-merge)
    ref_longer = plain_generate(model, longer, 12)
    forward_tokens.take()
    assert torch.equal(lm.generate(longer, max_new_tokens=12, do_sample=False), ref_longer)
    reused = (t - 1) // 64 * 64  # whole chunks of the shared prefix
    assert forward_tokens.take() == [longer.shape[1] - reused] + [1] * 11


def test_prefill_with_a_cached_prefix_gives_the_logits_of_a_full_forward(
        smollm: tuple[Any, Any], make_engine: Callable[..., LMCacheEngine]) -> None:
    model, tok = smollm
    lm = PrefixCacheLM(model, make_engine())
    ids = ids_of(tok, PROMPT + MORE)
    first = lm.prefill(ids[:, :128])
    assert (first.num_cached_tokens, first.num_computed_tokens) == (0, 128)
    out = lm.prefill(ids, logits_to_keep=0)
    assert out.num_cached_tokens == 128 and out.num_computed_tokens == ids.shape[1] - 128
    with torch.inference_mode():
        ref = model(ids).logits[0, 128:]
    torch.testing.assert_close(out.logits[0], ref, atol=1e-4, rtol=1e-4)
    assert out.past_key_values.get_seq_length() == ids.shape[1]


def test_save_decode_cache_also_stores_the_generated_tokens(
        smollm: tuple[Any, Any], make_engine: Callable[..., LMCacheEngine]) -> None:
    model, tok = smollm
    engine = make_engine(save_decode_cache=True)
    ids = ids_of(tok, PROMPT)
    out = PrefixCacheLM(model, engine).generate(ids, max_new_tokens=20, do_sample=False)
    # the cache holds the KV of every token but the last generated one, and all of it was stored
    assert engine.lookup(out[0, :-1]) == out.shape[1] - 1 > ids.shape[1]


def test_keys_are_shared_with_a_vllm_engine_for_the_same_model_dtype_and_tokens(
        smollm: tuple[Any, Any]) -> None:
    vllm_config = pytest.importorskip("vllm.config")
    from lmcache.integration.vllm.utils import engine_metadata

    model, tok = smollm
    config = LMCacheEngineConfig.from_defaults(chunk_size=64, max_local_cpu_size=0.01)
    hf = hf_engine_metadata(model, config)
    configs = SimpleNamespace(model_config=vllm_config.ModelConfig(model=model.name_or_path, dtype="float32"),
                              parallel_config=vllm_config.ParallelConfig())
    vllm = engine_metadata(configs, config, torch.float32, rank=0)
    assert hf.model_fingerprint and (hf.model_name, hf.model_fingerprint) == (vllm.model_name,
                                                                             vllm.model_fingerprint)
    tokens = ids_of(tok, PROMPT)[0]
    assert [k for *_, k in ChunkedTokenDatabase(config, hf).process_tokens(tokens)] == \
        [k for *_, k in ChunkedTokenDatabase(config, vllm).process_tokens(tokens)]
