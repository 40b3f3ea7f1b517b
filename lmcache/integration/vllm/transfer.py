"""Moving one request's KV between vLLM's paged cache and the engine, as a `RequestPlan` says.

Used by the worker-side connector and by the seed's adapter functions (`vllm_adapter`).
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.integration.vllm.metadata import RequestPlan


def slots_for(block_ids: list[int], n: int, block_size: int) -> torch.Tensor:
    """Slot of each of the first `n` tokens (-1 where no block is allocated yet)."""
    blocks = torch.tensor(block_ids[: -(-n // block_size)], dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
    if slots.shape[0] < n:
        slots = torch.cat([slots, torch.full((n - slots.shape[0],), -1, dtype=torch.int64)])
    return slots


def _skip_mask(n: int, skip_tokens: int, chunk_size: int) -> torch.Tensor | None:
    """Mask skipping the whole chunks below `skip_tokens` (None when there are none)."""
    skip = skip_tokens - skip_tokens % chunk_size
    return torch.arange(n) >= skip if skip else None


def load_plan(engine: LMCacheEngine, kvcaches: Any, plan: RequestPlan, block_size: int) -> int:
    """Load `plan`'s cached prefix into tokens [load_from, load_to) of vLLM's cache; returns the
    number of tokens now valid (<= load_to). Ends the request's lookup lease."""
    n = plan.retrieve_to
    slots = slots_for(plan.block_ids, n, block_size)
    slots[: plan.load_from] = -1  # vLLM's own prefix cache holds these: never overwrite
    slots[plan.load_to :] = -1  # vLLM computes these
    mask = _skip_mask(n, plan.load_from, engine.config.chunk_size)
    tokens = torch.tensor(plan.token_ids[:n], dtype=torch.int64)
    loaded = engine.retrieve(tokens, mask, extra_key=plan.extra_key, kvcaches=kvcaches, slot_mapping=slots)
    engine.release(plan.req_id)
    first = 0 if mask is None else int((~mask).sum())
    return min(first + int(loaded[first:].sum()), plan.load_to)


def save_plan(engine: LMCacheEngine, kvcaches: Any, plan: RequestPlan, block_size: int) -> None:
    """Store tokens [save_from, save_to) of the request (chunks cached already are skipped)."""
    n = plan.save_to
    tokens = torch.tensor(plan.token_ids[:n], dtype=torch.int64)
    engine.store(tokens, _skip_mask(n, plan.save_from, engine.config.chunk_size),
                 extra_key=plan.extra_key, kvcaches=kvcaches,
                 slot_mapping=slots_for(plan.block_ids, n, block_size))
