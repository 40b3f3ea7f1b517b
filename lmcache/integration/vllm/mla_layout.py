"""Where vLLM writes an MLA layer's latents, learned from the layer's own cache-write op.

An MLA cache holds one latent per token (``kv_lora_rank`` compressed-KV values, then
``qk_rope_head_dim`` rotary key values). `check_latent_rows` writes known latents through the
attention layer's ``impl.do_kv_cache_update`` (what vLLM calls in every forward) into a small
scratch cache shaped like the one the layer writes through (``layer.kv_cache``: vLLM binds the
registered ``[blocks, 1, block_size, latent]`` tensor squeezed to ``[blocks, block_size, latent]``,
and AMX's cache-write kernel accepts only that), and checks that the latent of slot s is row s of
the cache seen as ``[slots, latent]``: the layout the "mla" paged connector copies. Another layout
(a backend that tiles latents), or a write op that fails on the probe, raises ValueError saying so.
"""

from __future__ import annotations

from typing import Any

import torch

_DIGIT = 64  # small integers are exact in every float dtype a cache uses


def check_latent_rows(layer: Any, block_size: int) -> None:
    """`layer`: an MLA attention layer with its KV cache bound (``impl``, ``kv_cache``: one block per
    leading index). Raises ValueError unless latents are token-major rows."""
    impl, cache = layer.impl, layer.kv_cache
    width = cache.shape[-1]
    rank = int(getattr(impl, "kv_lora_rank", 0))
    if not 0 < rank < width:
        raise ValueError(f"an MLA cache of {width}-wide latents whose kv_lora_rank ({rank}) is unknown")
    slots = torch.arange(block_size, dtype=torch.int64) + block_size  # the middle one of 3 blocks
    t = torch.arange(block_size).view(-1, 1).expand(block_size, width)
    j = torch.arange(width).view(1, -1).expand(block_size, width)
    for values in (t % _DIGIT, t // _DIGIT, j % _DIGIT, j // _DIGIT):
        scratch = torch.full((3, *cache.shape[1:]), -1.0, dtype=cache.dtype)
        latent = values.to(cache.dtype)
        try:
            impl.do_kv_cache_update(latent[:, :rank].contiguous(), latent[:, rank:].unsqueeze(1).contiguous(),
                                    scratch, slots, "auto", torch.ones(1))
        except RuntimeError as e:  # vLLM's kernel refused the probe: the connector cannot learn the layout
            raise ValueError(f"{type(impl).__name__}'s cache write failed on a {tuple(scratch.shape)} probe "
                             f"cache: {e}") from e
        rows = scratch.reshape(-1, width)
        if not (torch.equal(rows[block_size: 2 * block_size], latent)
                and bool((rows[:block_size] == -1).all()) and bool((rows[2 * block_size:] == -1).all())):
            raise ValueError(f"{type(impl).__name__} does not keep MLA latents as token rows (its layout "
                             "is not one the connector copies)")
