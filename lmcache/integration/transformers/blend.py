"""`CacheBlendLM`: CacheBlend for HF Llama-family models — reuse the KV of passages wherever they
appear in the input, recomputing only a fraction of the tokens.

Inputs are segments separated by the special token sequence (the tokens of
``config.blend_special_str``), then a query: ``[passage_1, spt, passage_2, spt, ..., query]``.
Build them with `build_input` (each text is tokenized on its own, so passage tokens are the same in
every input) and precompute each segment's KV once with `precompute` (a plain prefill of the
segment alone, stored through the engine like any prefix). `prefill` then retrieves each segment's
KV independently of its position (`SPTBlendRetriever`, asynchronously), runs `LlamaBlendForward`
with a `CacheBlendImpl` (``blend_recompute_ratio``, ``blend_check_layers``), always recomputing the
query after the last separator. Inputs shorter than ``blend_min_tokens`` are simply prefilled.
Blended KV is approximate and is never stored. Prefills on one instance run one at a time (the
executor keeps per-input state between layers).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from lmcache.blend.executor import CacheBlendImpl
from lmcache.blend.retriever import SPTBlendRetriever, split_segments
from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.transformers.llama_blend import LlamaBlendForward
from lmcache.integration.transformers.prefix_cache import PrefixCacheLM, as_token_row, fit_cache_to_generate


@dataclass
class BlendPrefillOutput:
    """logits: ``[vocab]`` next-token logits. past_key_values: KV of all T input tokens.
    num_retrieved_tokens: tokens whose KV was found; num_recomputed_tokens: tokens computed in the
    last layer (T when not blended). blended: False if the input was simply prefilled."""

    logits: torch.Tensor
    past_key_values: DynamicCache
    num_retrieved_tokens: int
    num_recomputed_tokens: int
    blended: bool


class CacheBlendLM:
    def __init__(self, model: Any, engine: LMCacheEngine, *, tokenizer: Any = None,
                 spt: torch.Tensor | Sequence[int] | None = None,
                 config: LMCacheEngineConfig | None = None) -> None:
        """`spt`: the separator's token ids; default: `tokenizer` applied to
        ``config.blend_special_str``. `config`: the blending settings (default: the engine's)."""
        config = config or engine.config
        if not config.enable_blending:
            raise ValueError("enable_blending=False in the engine's config; set it to use CacheBlend")
        if spt is None:
            if tokenizer is None:
                raise ValueError("pass the separator token ids (spt=) or a tokenizer")
            spt = tokenizer(config.blend_special_str, add_special_tokens=False)["input_ids"]
        self.spt = torch.as_tensor(spt, dtype=torch.int64).reshape(-1)
        self.model = model
        self.tokenizer = tokenizer
        self.engine = engine
        self.config = config
        self.prefix = PrefixCacheLM(model, engine)
        self.executor = CacheBlendImpl.from_config(config)
        self.forward = LlamaBlendForward(model, self.executor)
        self.retriever = SPTBlendRetriever(self.spt, engine, engine.metadata, device=self.prefix.device)
        self._lock = threading.Lock()

    # ---- inputs ---------------------------------------------------------------------------------

    def _encode(self, text: str) -> torch.Tensor:
        if self.tokenizer is None:
            raise ValueError("CacheBlendLM was built without a tokenizer")
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)

    def encode_segment(self, text: str) -> torch.Tensor:
        """The tokens of one reusable segment: `text` followed by the separator."""
        return torch.cat([self._encode(text), self.spt])

    def build_input(self, segments: Sequence[str], query: str) -> torch.Tensor:
        """``[T]`` ids: every segment (with its separator), then the query."""
        return torch.cat([*(self.encode_segment(s) for s in segments), self._encode(query)])

    def query_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """CPU bool ``[T]``: True on the tokens after the last separator (the query)."""
        tokens = as_token_row(input_ids)
        mask = torch.zeros(tokens.numel(), dtype=torch.bool)
        start, end = split_segments(tokens, self.spt)[-1]
        m = self.spt.numel()
        if not (end - start >= m and torch.equal(tokens[end - m:end], self.spt)):
            mask[start:end] = True
        return mask

    # ---- cache ----------------------------------------------------------------------------------

    def precompute(self, segment_ids: torch.Tensor) -> int:
        """Compute and store the KV of one segment on its own (positions from 0); returns how many
        of its tokens had to be computed (0 if it was fully cached)."""
        tokens = as_token_row(segment_ids)
        if self.engine.lookup(tokens) == tokens.numel():
            return 0
        return self.prefix.prefill(tokens).num_computed_tokens

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> BlendPrefillOutput:
        tokens = as_token_row(input_ids)
        n = tokens.numel()
        if n < self.config.blend_min_tokens:
            cache = self.prefix.new_cache()
            out = self.model(input_ids=tokens.unsqueeze(0).to(self.prefix.device), past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            return BlendPrefillOutput(out.logits[0, -1], cache, 0, n, False)
        with self._lock:
            task = self.retriever.new_request(tokens, torch.tensor([0, n]))
            out = self.forward(tokens, task, force_recompute=self.query_mask(tokens))
        return BlendPrefillOutput(out.logits, out.past_key_values, task.num_retrieved_tokens,
                                  out.recomputed.numel(), True)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, **generate_kwargs: Any) -> torch.Tensor:
        """`model.generate` after a blended prefill: the blended KV of all but the last token is
        the cache, so generation recomputes just that token and continues normally."""
        if "past_key_values" in generate_kwargs:
            raise ValueError("past_key_values is managed by CacheBlendLM.generate")
        tokens = as_token_row(input_ids)
        cache = self.prefill(tokens).past_key_values
        cache.crop(-1)  # drop the last token: generate recomputes it
        fit_cache_to_generate(self.model, cache, generate_kwargs)
        ids = tokens.unsqueeze(0).to(self.prefix.device)
        generate_kwargs.setdefault("attention_mask", torch.ones_like(ids))
        return self.model.generate(input_ids=ids, past_key_values=cache, **generate_kwargs)

    def close(self) -> None:
        self.retriever.close()
