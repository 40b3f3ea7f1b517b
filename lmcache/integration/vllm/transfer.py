"""Moving one request's KV between vLLM's paged cache and the engine, as a `RequestPlan` says.

Used by the worker-side connector and by seed 004's adapter functions (`lmcache.compat.vllm_adapter`).

Slots. Each KV cache group has its own block table, so the slot of a token is per group:
``block_id * block_size + offset`` in the group's table, -1 where the group holds nothing for it
(no block allocated yet, vLLM's null block, tokens vLLM's own prefix cache holds on a load, a
sliding-window row a stored chunk does not keep). A model with one group passes the connector a
``[N]`` slot mapping; a model with several a ``[G, N]`` one (row g for `groups[g]`, the connector
maps each layer to its group's row).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.integration.vllm.kv_groups import NULL_BLOCK, KVGroup
from lmcache.integration.vllm.metadata import RequestPlan
from lmcache.integration.vllm.states import StateCopier


def slots_for(block_ids: Sequence[int], n: int, block_size: int) -> torch.Tensor:
    """Slot of each of the first `n` tokens in one group's block table (-1 where no block is
    allocated yet, or the block is vLLM's null block)."""
    blocks = torch.tensor(list(block_ids[: -(-n // block_size)]), dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
    slots[(blocks == NULL_BLOCK).repeat_interleave(block_size)[: slots.shape[0]]] = -1
    if slots.shape[0] < n:
        slots = torch.cat([slots, torch.full((n - slots.shape[0],), -1, dtype=torch.int64)])
    return slots


def _skip_mask(n: int, skip_tokens: int, chunk_size: int) -> torch.Tensor | None:
    """Mask skipping the whole chunks below `skip_tokens` (None when there are none)."""
    skip = skip_tokens - skip_tokens % chunk_size
    return torch.arange(n) >= skip if skip else None


def _as_mapping(rows: list[torch.Tensor]) -> torch.Tensor:
    """One group: its ``[N]`` slots; several: ``[G, N]``."""
    return rows[0] if len(rows) == 1 else torch.stack(rows)


def load_slots(groups: Sequence[KVGroup], plan: RequestPlan) -> torch.Tensor:
    """Where each of the first `plan.retrieve_to` tokens is written on a load: only tokens
    ``[load_from, load_to)``, only into blocks the group holds."""
    rows = []
    for group in groups:
        slots = slots_for(plan.block_ids[group.index], plan.retrieve_to, group.block_size)
        slots[: plan.load_from] = -1  # vLLM's own prefix cache holds these: never overwrite
        slots[plan.load_to :] = -1  # vLLM computes these
        rows.append(slots)
    return _as_mapping(rows)


def save_slots(groups: Sequence[KVGroup], plan: RequestPlan, chunk_size: int) -> tuple[torch.Tensor, int]:
    """Where each of the first `plan.save_to` tokens is read on a save, and the first token of the
    chunks that can be stored: a sliding-window group's rows below `first_kept` of their chunk's
    end are not read (stored as zeros); a chunk whose kept rows lie in a block the group no longer
    holds (vLLM's own prefix cache gave the request only the window's blocks) cannot be stored,
    nor can any chunk before it."""
    n, first = plan.save_to, plan.save_from
    rows = []
    for group in groups:
        slots = slots_for(plan.block_ids[group.index], n, group.block_size)
        if group.first_kept(n) > 0:
            starts = range(first - first % chunk_size, n, chunk_size)
            for start in starts:
                end = min(start + chunk_size, n)
                kept = max(start, group.first_kept(end))
                if bool((slots[kept:end] < 0).any()):
                    first = max(first, end)
                slots[start:kept] = -1
        rows.append(slots)
    return _as_mapping(rows), first


def load_plan(engine: LMCacheEngine, kvcaches: Any, plan: RequestPlan, groups: Sequence[KVGroup],
              states: StateCopier | None = None) -> int:
    """Load `plan`'s cached prefix into tokens [load_from, load_to) of vLLM's cache (`groups`: the
    groups stored per token; `states`: a hybrid model's recurrent layers, whose state after
    load_to tokens is loaded first: without it nothing is); returns the number of tokens now
    valid (vLLM's own load_from, up to load_to). Ends the request's lookup lease."""
    try:
        if states is not None and not _load_state(engine, plan, states):
            return plan.load_from
        n = plan.retrieve_to
        slots = load_slots(groups, plan)
        # chunks with no token to write (below every group's window) are not even read
        written = (slots >= 0).view(-1, n).any(dim=0).nonzero()
        first_written = int(written[0]) if written.numel() else plan.load_to
        mask = _skip_mask(n, max(plan.load_from, first_written), engine.config.chunk_size)
        tokens = torch.tensor(plan.token_ids[:n], dtype=torch.int64)
        loaded = engine.retrieve(tokens, mask, extra_key=plan.extra_key, kvcaches=kvcaches,
                                 slot_mapping=slots)
        first = 0 if mask is None else int((~mask).sum())
        return max(plan.load_from, min(first + int(loaded[first:].sum()), plan.load_to))
    finally:
        engine.release(plan.req_id)


def _load_state(engine: LMCacheEngine, plan: RequestPlan, states: StateCopier) -> bool:
    tokens = torch.tensor(plan.token_ids[: plan.load_to], dtype=torch.int64)
    obj = engine.retrieve_state(tokens, extra_key=plan.extra_key)
    if obj is None:
        return False
    try:
        stored = obj.tensor
        assert stored is not None
        return states.scatter(plan.block_ids, plan.load_to, stored.view(torch.uint8)[: states.nbytes])
    finally:
        obj.ref_count_down()


def save_plan(engine: LMCacheEngine, kvcaches: Any, plan: RequestPlan, groups: Sequence[KVGroup],
              states: StateCopier | None = None) -> int:
    """Store tokens [save_from, save_to) of the request (chunks cached already are skipped), and
    the recurrent layers' state after `save_state_at` tokens; returns the first token stored from
    (> save_from when leading chunks cannot be stored)."""
    n = first = plan.save_to
    if n > plan.save_from:
        slots, first = save_slots(groups, plan, engine.config.chunk_size)
        if first < n:
            tokens = torch.tensor(plan.token_ids[:n], dtype=torch.int64)
            engine.store(tokens, _skip_mask(n, first, engine.config.chunk_size),
                         extra_key=plan.extra_key, kvcaches=kvcaches, slot_mapping=slots)
    boundary = plan.save_state_at
    if states is not None and boundary > 0:
        tokens = torch.tensor(plan.token_ids[:boundary], dtype=torch.int64)
        inside = boundary % engine.config.chunk_size
        if inside:  # a state inside a chunk: resuming there needs the prefix's trailing partial chunk
            tail = dataclasses.replace(plan, save_from=boundary - inside, save_to=boundary, save_state_at=0)
            save_plan(engine, kvcaches, tail, groups)
        engine.store_state(tokens, states.nbytes, partial(states.gather, plan.block_ids, boundary),
                           extra_key=plan.extra_key)
    return first
