"""`VLLMCPUPackedConnector`: vLLM-CPU's packed paged caches <-> canonical `KV_BLOB` objects.

``kvcaches`` = per-layer tensors ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` in the
packed layout that `cpu_layout.probe_packed_layout` found; ``slot_mapping`` = slot of every token of
the whole sequence (block_id * block_size + offset). Because the objects hold the canonical layout,
KV stored by vLLM-CPU is shared with vLLM on CUDA and with HF transformers.

A layout on `BatchedKVConnector`: the request-level checks and the slot rule are shared (a store
rejects negative slots, a retrieve skips them: blocks the engine already holds are never
overwritten). For the layouts of a known kind (`cpu_layout.KINDS`: vec / vec16, and amx for bf16)
all chunks of a request move in ONE native call (`lmcache.native.lmc_packed_copy`: vec K
transposed in tiles of the widest vector path the CPU has, SSE2, AVX2 or AVX-512; whole 16-token
K tiles transposed in 4-byte units and token pairs of V interleaved for amx). Without it, vec
blocks go through `index_select` / `index_copy_` on zero-copy strided views and partial blocks
through per-token indexing; any other layout (and amx) goes through its permutations.

Several KV cache groups (`layer_groups`: each layer's group): the slot mapping is ``[G, T]``, one
row per group, and each layer reads its group's row; a store writes zeros for a token its layer's
group does not hold (slot < 0: a sliding-window row outside what the chunk keeps).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache import native
from lmcache.gpu_connector import BatchedKVConnector, CopyDone, CopyRequest, finish
from lmcache.gpu_connector.batched import slots_from_mapping
from lmcache.integration.vllm.cpu_layout import KINDS, PackedLayout


@dataclass
class PackedCaches:
    """One engine's per-layer packed caches (`kvcaches`), with what the copies need of them."""

    kvcaches: list[torch.Tensor]
    num_slots: int
    dtype: torch.dtype
    ptrs: torch.Tensor  # int64 address of each layer (native kernel)
    views: list[tuple[torch.Tensor, torch.Tensor]] | None  # strided K, V token views (vec only)


class VLLMCPUPackedConnector(BatchedKVConnector):
    def __init__(self, hidden_dim_size: int, num_layers: int, layout: PackedLayout, *,
                 use_native: bool = True, layer_groups: Sequence[int] | None = None) -> None:
        super().__init__(hidden_dim_size, num_layers)
        if layout.num_kv_heads * layout.head_size != hidden_dim_size:
            raise ValueError(f"layout has {layout.num_kv_heads} heads x {layout.head_size} values, "
                             f"connector hidden size is {hidden_dim_size}")
        groups = tuple(layer_groups) if layer_groups is not None else (0,) * num_layers
        if len(groups) != num_layers or min(groups) < 0:
            raise ValueError(f"layer_groups {groups} must name a group >= 0 for each of {num_layers} layers")
        self.layer_groups = torch.tensor(groups, dtype=torch.int64)
        self.num_groups = max(groups) + 1
        self.layout = layout
        self._native = native.load() if use_native and layout.kind is not None else None
        self._caches: tuple[tuple[int, int], PackedCaches] | None = None

    def _target(self, kvcaches: Any, dtype: torch.dtype) -> PackedCaches:
        if not isinstance(kvcaches, (list, tuple)) or len(kvcaches) != self.num_layers \
                or not all(isinstance(kv, torch.Tensor) for kv in kvcaches):
            n = len(kvcaches) if hasattr(kvcaches, "__len__") else "?"
            raise ValueError(f"kvcaches must be {self.num_layers} per-layer tensors, got {n}")
        ident = (id(kvcaches), kvcaches[0].data_ptr())
        if self._caches is None or self._caches[0] != ident:
            self._caches = (ident, self._resolve(list(kvcaches)))
        caches = self._caches[1]
        if caches.dtype != dtype:
            raise ValueError(f"KV dtype {caches.dtype} does not match memory object dtype {dtype}")
        return caches

    def _resolve(self, kvcaches: list[torch.Tensor]) -> PackedCaches:
        lay = self.layout
        expected = (lay.num_kv_heads, lay.block_size, 2 * lay.head_size)
        for kv in kvcaches:
            if (tuple(kv.shape[1:]) != expected or not kv.is_contiguous() or kv.device.type != "cpu"
                    or kv.shape[0] != kvcaches[0].shape[0] or kv.dtype != kvcaches[0].dtype):
                raise ValueError(f"vLLM-CPU cache must be contiguous CPU [num_blocks, {expected[0]}, "
                                 f"{expected[1]}, {expected[2]}] tensors of one dtype, got "
                                 f"{tuple(kv.shape)} {kv.dtype} {kv.device}")
        views = [lay.token_views(kv) for kv in kvcaches] if lay.is_vec else None
        return PackedCaches(kvcaches, kvcaches[0].shape[0] * lay.block_size, kvcaches[0].dtype,
                            torch.tensor([kv.data_ptr() for kv in kvcaches], dtype=torch.int64), views)

    def _token_slots(self, kwargs: dict[str, Any], starts: Sequence[int], ends: Sequence[int],
                     target: PackedCaches) -> torch.Tensor:
        slots = slots_from_mapping(kwargs, starts, ends)
        rows = 1 if slots.dim() == 1 else slots.shape[0]
        if rows != self.num_groups or (slots.dim() == 2 and self.num_groups == 1):
            raise ValueError(f"slot_mapping of shape {tuple(slots.shape)}: this connector's layers belong "
                             f"to {self.num_groups} KV cache group(s), one slot row each"
                             + (" ([T] for one group)" if self.num_groups == 1 else ""))
        return slots

    def _copy(self, target: PackedCaches, request: CopyRequest, on_done: CopyDone) -> None:
        slots = request.slots.view(self.num_groups, -1)
        native_sizes = (2,) if self.layout.kind == "amx" else (2, 4)
        if self._native is not None and target.dtype.itemsize in native_sizes:
            self._copy_native(target, request, slots)
        else:
            for c, blob in enumerate(request.blobs):
                self._copy_chunk(target, slots[:, request.bounds[c]: request.bounds[c + 1]], blob,
                                 request.gather)
        finish(on_done)

    def _copy_native(self, caches: PackedCaches, request: CopyRequest, slots: torch.Tensor) -> None:
        assert self._native is not None
        lay = self.layout
        bounds = torch.tensor(request.bounds, dtype=torch.int64)
        bufs = torch.tensor([b.data_ptr() for b in request.blobs], dtype=torch.int64)
        rc = self._native.lmc_packed_copy(
            ctypes.c_void_p(caches.ptrs.data_ptr()), self.num_layers, caches.kvcaches[0].shape[0],
            lay.num_kv_heads, lay.head_size, lay.block_size, caches.dtype.itemsize,
            KINDS.index(lay.kind or ""), ctypes.c_void_p(slots.data_ptr()), self.num_groups,
            ctypes.c_void_p(self.layer_groups.data_ptr()), ctypes.c_void_p(bounds.data_ptr()),
            ctypes.c_void_p(bufs.data_ptr()), request.num_chunks, 0 if request.gather else 1,
            torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native vLLM-CPU copy failed (code {rc}) on slots checked in range")

    def _copy_chunk(self, caches: PackedCaches, slots: torch.Tensor, blob: torch.Tensor,
                    gather: bool) -> None:
        """blob: [2, L, n, hidden] on CPU; slots: [G, n] int64, one row per KV cache group
        (negative: skipped by a scatter, zeros from a gather)."""
        lay = self.layout
        bs, h, d = lay.block_size, lay.num_kv_heads, lay.head_size
        n = slots.shape[1]
        whole = [_whole_blocks(row, bs) for row in slots]
        for layer in range(self.num_layers):
            group = int(self.layer_groups[layer])
            layer_slots, blocks = slots[group], whole[group]
            if caches.views is None:
                _permuted_copy(caches.kvcaches[layer], lay, layer_slots, blob[:, layer].view(2, n, h, d),
                               gather)
                continue
            for i, view in enumerate(caches.views[layer]):
                rows = blob[i, layer].view(n, h, d)
                if blocks is not None:
                    _blocks_copy(view, blocks, rows.view(-1, bs, h, d), gather)
                else:
                    _tokens_copy(view, layer_slots, bs, rows, gather)


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
    """Per-token copy; negative slots are skipped on a scatter and gather zeros."""
    keep = slots >= 0
    if gather:
        if bool(keep.all()):
            rows.copy_(view[slots // block_size, slots % block_size])
        else:
            rows.zero_()
            s = slots[keep]
            rows[keep] = view[s // block_size, s % block_size]
        return
    s = slots[keep]
    view[s // block_size, s % block_size] = rows[keep]


def _permuted_copy(kv: torch.Tensor, lay: PackedLayout, slots: torch.Tensor, rows: torch.Tensor,
                   gather: bool) -> None:
    """Any probed layout, through the permutations: decode the touched blocks, copy tokens,
    re-encode on scatter. kv: [num_blocks, h, bs, 2d]; rows: [2, n, h, d]."""
    bs, h, d = lay.block_size, lay.num_kv_heads, lay.head_size
    keep = slots >= 0
    if not bool(keep.any()):  # the engine holds every token of the range (or, storing, none)
        if gather:
            rows.zero_()
        return
    s = slots[keep]
    uniq, which = torch.unique(s // bs, return_inverse=True)
    flat = kv.view(kv.shape[0], -1)
    packed = flat.index_select(0, uniq)  # [u, 2 * bs * h * d]
    offsets = s % bs
    for i, perm in enumerate((lay.k_perm, lay.v_perm)):
        decoded = packed[:, perm].view(-1, bs, h, d)
        if gather:
            if bool(keep.all()):
                rows[i].copy_(decoded[which, offsets])
            else:
                rows[i].zero_()
                rows[i][keep] = decoded[which, offsets]
        else:
            decoded[which, offsets] = rows[i][keep]
            packed[:, perm] = decoded.view(len(uniq), -1)
    if not gather:
        flat.index_copy_(0, uniq, packed)


def permuted_gather(connector: VLLMCPUPackedConnector, kvcaches: Sequence[torch.Tensor],
                    slots: torch.Tensor) -> torch.Tensor:
    """The KV of the tokens at `slots` (``[n]``, or ``[G, n]`` one row per KV cache group; < 0:
    zeros) as a chunk tensor ``[2, num_layers, n, hidden]``, decoded through the layout's probed
    permutations only: independent of the copies `connector` stores and loads with (the reference
    an audit compares them against)."""
    lay = connector.layout
    rows = slots.view(connector.num_groups, -1)
    n = rows.shape[1]
    out = torch.empty(2, connector.num_layers, n, lay.num_kv_heads * lay.head_size, dtype=kvcaches[0].dtype)
    for layer, kv in enumerate(kvcaches):
        _permuted_copy(kv, lay, rows[int(connector.layer_groups[layer])], out[:, layer].view(
            2, n, lay.num_kv_heads, lay.head_size), gather=True)
    return out
