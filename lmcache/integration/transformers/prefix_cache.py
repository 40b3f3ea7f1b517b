"""Prefix reuse for HF transformers causal LMs (`DynamicCache`, batch 1).

`PrefixCacheLM(model, engine)`:

- `load_prefix(ids)`: look up the longest cached prefix and load it into a fresh `DynamicCache`
  (at most ``len(ids) - 1`` tokens, so the model always computes at least the last token);
- `store(ids, past_key_values)`: store the KV of `ids` from a cache (chunks already cached are
  skipped by the engine);
- `prefill(ids)`: load the prefix, run the model only on the rest, store what is new;
- `generate(ids, **generate_kwargs)`: the same around `model.generate` (any HF generation options);
  it stores the prompt's KV, and with ``save_decode_cache`` the generated tokens' KV too.

A cache whose layers do not hold every token's KV (sliding-window layers past their window) is
not stored: such prompts are always computed.

The engine is normally `create_hf_engine(model, config)`; its connector reads and writes HF's
``[1, num_kv_heads, T, head_size]`` tensors directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from lmcache.cache_engine import LMCacheEngine
from lmcache.integration.transformers.engine import KVGeometry

logger = logging.getLogger(__name__)


@dataclass
class PrefillOutput:
    """logits: ``[1, n, vocab]`` of the last `n` computed tokens (``logits_to_keep``).
    past_key_values: the KV of all input tokens. num_cached_tokens: tokens loaded from the cache;
    num_computed_tokens: tokens the model computed."""

    logits: torch.Tensor
    past_key_values: DynamicCache
    num_cached_tokens: int
    num_computed_tokens: int


def as_token_row(input_ids: torch.Tensor) -> torch.Tensor:
    """``[T]`` or ``[1, T]`` integer ids -> ``[T]`` int64 on the CPU; ValueError otherwise."""
    ids = input_ids[0] if input_ids.dim() == 2 and input_ids.shape[0] == 1 else input_ids
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be non-empty integer ids of shape [T] or [1, T] (batch 1), "
                         f"got {input_ids.dtype} of shape {tuple(input_ids.shape)}")
    return ids.to("cpu", torch.int64)


def fit_cache_to_generate(model: Any, cache: DynamicCache, generate_kwargs: dict[str, Any]) -> int:
    """Repeat the batch row of a prefilled `cache` for every row `model.generate(**generate_kwargs)`
    runs per prompt (``max(num_beams, num_return_sequences)``, from the generation config and its
    overrides): generate widens its inputs, not a cache passed in. Returns that number of rows."""
    config = generate_kwargs.get("generation_config") or model.generation_config
    rows = max(generate_kwargs.get("num_beams", config.num_beams) or 1,
               generate_kwargs.get("num_return_sequences", config.num_return_sequences) or 1)
    if rows > 1 and cache.get_seq_length() > 0:
        cache.batch_repeat_interleave(rows)
    return rows


class PrefixCacheLM:
    def __init__(self, model: Any, engine: LMCacheEngine) -> None:
        geo = KVGeometry.of(model)
        if engine.metadata.num_layers != geo.num_layers or engine.metadata.hidden_dim != \
                geo.num_kv_heads * geo.head_size:
            raise ValueError(f"engine KV shape {engine.metadata.kv_shape} does not fit the model "
                             f"({geo.num_layers} layers, {geo.num_kv_heads} KV heads of {geo.head_size})")
        if engine.metadata.kv_dtype != model.dtype:
            raise ValueError(f"the engine's KV dtype {engine.metadata.kv_dtype} differs from the model's "
                             f"dtype {model.dtype}; build the engine for the model in its dtype")
        self.model = model
        self.engine = engine
        self.geometry = geo
        self._warned_unstorable = False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def load_prefix(self, input_ids: torch.Tensor) -> tuple[DynamicCache, int]:
        """A cache holding the longest cached prefix of `input_ids` (at most T - 1 tokens), and
        its length."""
        tokens = as_token_row(input_ids)
        cache = self.new_cache()
        hit = self.engine.lookup(tokens)
        if min(hit, tokens.numel() - 1) <= 0:
            return cache, 0
        geo = self.geometry
        shape = (1, geo.num_kv_heads, hit, geo.head_size)
        kv = [(torch.empty(shape, dtype=self.engine.metadata.kv_dtype, device=self.device),
               torch.empty(shape, dtype=self.engine.metadata.kv_dtype, device=self.device))
              for _ in range(geo.num_layers)]
        loaded = int(self.engine.retrieve(tokens[:hit], kvcaches=kv).sum())  # fewer if evicted meanwhile
        n = min(loaded, tokens.numel() - 1)
        if n <= 0:
            return cache, 0
        for layer, (k, v) in enumerate(kv):
            cache.update(k[:, :, :n], v[:, :, :n], layer)
        return cache, n

    def store(self, input_ids: torch.Tensor, past_key_values: DynamicCache) -> None:
        """Store the KV of the first ``min(T, cache length)`` tokens of `input_ids` (batch row 0);
        nothing if a layer holds only the last tokens' KV (a sliding window)."""
        tokens = as_token_row(input_ids)
        length = past_key_values.get_seq_length()
        n = min(tokens.numel(), length)
        if n <= 0:
            return
        held = min(layer.keys.shape[-2] for layer in past_key_values.layers)  # type: ignore[union-attr]
        if held < length:
            if not self._warned_unstorable:
                logger.warning("not storing the KV of %d tokens: a layer of the cache holds only the "
                               "last %d (a sliding window); such prompts are computed", length, held)
                self._warned_unstorable = True
            return
        kv = [(layer.keys[:1], layer.values[:1]) for layer in past_key_values.layers]  # type: ignore[union-attr,index]
        self.engine.store(tokens[:n], kvcaches=kv)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, *, logits_to_keep: int = 1) -> PrefillOutput:
        """Load the cached prefix, compute the rest, store the new KV. `logits_to_keep`: how many
        last positions get logits (0 = every computed token)."""
        tokens = as_token_row(input_ids)
        cache, n = self.load_prefix(tokens)
        out = self.model(input_ids=tokens[n:].unsqueeze(0).to(self.device), past_key_values=cache,
                         use_cache=True, logits_to_keep=logits_to_keep)
        self.store(tokens, cache)
        return PrefillOutput(out.logits, cache, n, tokens.numel() - n)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, **generate_kwargs: Any) -> torch.Tensor:
        """`model.generate` over the cached prefix; returns its ``[num_sequences, T + new]`` ids."""
        if "past_key_values" in generate_kwargs:
            raise ValueError("past_key_values is managed by PrefixCacheLM.generate")
        tokens = as_token_row(input_ids)
        cache, _ = self.load_prefix(tokens)
        rows = fit_cache_to_generate(self.model, cache, generate_kwargs)
        ids = tokens.unsqueeze(0).to(self.device)
        generate_kwargs.setdefault("attention_mask", torch.ones_like(ids))
        out = self.model.generate(input_ids=ids, past_key_values=cache, **generate_kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        decode_kv_is_row0 = sequences.shape[0] == 1 and rows == 1
        keep = sequences[0] if self.engine.config.save_decode_cache and decode_kv_is_row0 else tokens
        self.store(keep, cache)
        return out
