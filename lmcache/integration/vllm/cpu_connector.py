"""`VLLMCPUPackedConnector`: vLLM-CPU's packed paged caches <-> canonical `KV_BLOB` objects.

``kvcaches`` = per-layer tensors ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` in the
packed layout that `cpu_layout.probe_packed_layout` found; ``slot_mapping`` = slot of every token of
the whole sequence (block_id * block_size + offset). Because the objects hold the canonical layout,
KV stored by vLLM-CPU is shared with vLLM on CUDA and with HF transformers.

On `to_gpu`, tokens whose slot is negative are skipped: they belong to blocks the engine already
holds (its own prefix cache), which must never be overwritten. `from_gpu` rejects negative slots.
On the vec ISAs the copies run in a native kernel (`lmcache.native`, one call per chunk); without
it, whole blocks go through `index_select` / `index_copy_` on zero-copy strided views and partial
blocks through per-token indexing. Other ISAs (AMX tiles) go through the probed permutations.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from lmcache import native
from lmcache.gpu_connector import KVBlobConnector, require_kvcaches, require_slot_mapping
from lmcache.integration.vllm.cpu_layout import PackedLayout
from lmcache.memory_management import MemoryObj


class VLLMCPUPackedConnector(KVBlobConnector):
    def __init__(self, hidden_dim_size: int, num_layers: int, layout: PackedLayout, *,
                 use_native: bool = True) -> None:
        super().__init__(hidden_dim_size, num_layers)
        self._native = native.load() if use_native and layout.is_vec else None
        self._ptrs_for: tuple[int, int] | None = None
        self._ptrs = torch.empty(0, dtype=torch.int64)
        if layout.num_kv_heads * layout.head_size != hidden_dim_size:
            raise ValueError(f"layout has {layout.num_kv_heads} heads x {layout.head_size} values, "
                             f"connector hidden size is {hidden_dim_size}")
        self.layout = layout
        self._views_for: tuple[int, int] | None = None
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        blob = self.blob_of(memory_obj, start, end, set_fmt=True)
        kvcaches, slots = self._inputs(kwargs, start, end)
        if bool((slots < 0).any()):
            raise ValueError(f"slot_mapping has negative slots inside [{start}, {end}): those tokens "
                             "have no KV in this engine to store")
        self._copy(kvcaches, slots, blob, gather=True)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        blob = self.blob_of(memory_obj, start, end, set_fmt=False)
        kvcaches, slots = self._inputs(kwargs, start, end)
        self._copy(kvcaches, slots, blob, gather=False)

    # ---- internals ------------------------------------------------------------------------------

    def _inputs(self, kwargs: dict[str, Any], start: int,
                end: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        kvcaches = require_kvcaches(kwargs)
        slot_mapping = require_slot_mapping(kwargs)
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"kvcaches has {len(kvcaches)} layers, expected {self.num_layers}")
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] < end:
            raise ValueError(f"slot_mapping of shape {tuple(slot_mapping.shape)} does not cover "
                             f"tokens [{start}, {end})")
        lay = self.layout
        expected = (lay.num_kv_heads, lay.block_size, 2 * lay.head_size)
        first = kvcaches[0]
        if tuple(first.shape[1:]) != expected or not first.is_contiguous():
            raise ValueError(f"vLLM-CPU cache must be contiguous [num_blocks, {expected[0]}, "
                             f"{expected[1]}, {expected[2]}], got {tuple(first.shape)}")
        slots = slot_mapping[start:end].to("cpu", torch.int64)
        if bool((slots >= first.shape[0] * lay.block_size).any()):
            raise ValueError(f"slot_mapping has slots beyond the cache's {first.shape[0]} blocks")
        return kvcaches, slots

    def _token_views(self, kvcaches: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ident = (id(kvcaches), kvcaches[0].data_ptr())
        if self._views_for != ident:
            self._views = [self.layout.token_views(kv) for kv in kvcaches]
            self._views_for = ident
        return self._views

    def _copy(self, kvcaches: list[torch.Tensor], slots: torch.Tensor, blob: torch.Tensor,
              gather: bool) -> None:
        """blob: [2, L, n, hidden] on CPU; slots: [n] int64 (negative = skip, scatter only)."""
        lay = self.layout
        bs, h, d = lay.block_size, lay.num_kv_heads, lay.head_size
        n = slots.shape[0]
        if self._native is not None and blob.element_size() in (2, 4) and blob.is_contiguous():
            self._copy_native(kvcaches, slots, blob, gather)
            return
        blocks = _whole_blocks(slots, bs)
        if lay.is_vec:
            views = self._token_views(kvcaches)
            for layer, (k, v) in enumerate(views):
                for i, view in ((0, k), (1, v)):
                    rows = blob[i, layer].view(n, h, d)
                    if blocks is not None:
                        _blocks_copy(view, blocks, rows.view(-1, bs, h, d), gather)
                    else:
                        _tokens_copy(view, slots, bs, rows, gather)
        else:
            for layer, kv in enumerate(kvcaches):
                _permuted_copy(kv, lay, slots, blob[:, layer].view(2, n, h, d), gather)


    def _copy_native(self, kvcaches: list[torch.Tensor], slots: torch.Tensor, blob: torch.Tensor,
                     gather: bool) -> None:
        assert self._native is not None
        ident = (id(kvcaches), kvcaches[0].data_ptr())
        if self._ptrs_for != ident:
            self._ptrs = torch.tensor([kv.data_ptr() for kv in kvcaches], dtype=torch.int64)
            self._ptrs_for = ident
        lay = self.layout
        slots = slots.contiguous()
        rc = self._native.lmc_vec_packed_copy(
            ctypes.c_void_p(self._ptrs.data_ptr()), len(kvcaches), kvcaches[0].shape[0],
            lay.num_kv_heads, lay.head_size, lay.block_size, blob.element_size(),
            ctypes.c_void_p(slots.data_ptr()), slots.shape[0], ctypes.c_void_p(blob.data_ptr()),
            0 if gather else 1, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"native vLLM-CPU copy rejected the slot mapping (code {rc})")


def _whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """Block ids if `slots` is a sequence of complete blocks (each 0..bs-1 in order), else None."""
    n = slots.shape[0]
    if n == 0 or n % block_size:
        return None
    per_block = slots.view(-1, block_size)
    first = per_block[:, :1]
    if bool((first % block_size != 0).any()) or not torch.equal(
            per_block, first + torch.arange(block_size)):
        return None
    return first.flatten() // block_size


def _blocks_copy(view: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, gather: bool) -> None:
    """view: [num_blocks, bs, h, d] (strided); rows: [len(blocks), bs, h, d] contiguous."""
    if gather:
        torch.index_select(view, 0, blocks, out=rows)
    else:
        view.index_copy_(0, blocks, rows)


def _tokens_copy(view: torch.Tensor, slots: torch.Tensor, block_size: int, rows: torch.Tensor,
                 gather: bool) -> None:
    """Per-token copy; on scatter, negative slots are skipped."""
    if gather:
        rows.copy_(view[slots // block_size, slots % block_size])
        return
    keep = slots >= 0
    s = slots[keep]
    view[s // block_size, s % block_size] = rows[keep]


def _permuted_copy(kv: torch.Tensor, lay: PackedLayout, slots: torch.Tensor, rows: torch.Tensor,
                   gather: bool) -> None:
    """Any probed layout, through the permutations: decode the touched blocks, copy tokens,
    re-encode on scatter. kv: [num_blocks, h, bs, 2d]; rows: [2, n, h, d]."""
    bs, h, d = lay.block_size, lay.num_kv_heads, lay.head_size
    keep = slots >= 0
    s = slots[keep]
    uniq, which = torch.unique(s // bs, return_inverse=True)
    flat = kv.view(kv.shape[0], -1)
    packed = flat.index_select(0, uniq)  # [u, 2 * bs * h * d]
    offsets = s % bs
    for i, perm in enumerate((lay.k_perm, lay.v_perm)):
        decoded = packed[:, perm].view(-1, bs, h, d)
        if gather:
            rows[i].copy_(decoded[which, offsets])
        else:
            decoded[which, offsets] = rows[i][keep]
            packed[:, perm] = decoded.view(len(uniq), -1)
    if not gather:
        flat.index_copy_(0, uniq, packed)
