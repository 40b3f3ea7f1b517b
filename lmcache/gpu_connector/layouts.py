"""The KV cache layouts connectors accept, each turned into `KVSources` (all K, then all V).

Paged layouts (``kvcaches`` = one entry per layer, a token's place given by the slot mapping):

- ``"kv_tuples"``: the seed's per-layer ``(K, V)``, each ``[num_blocks, block_size, heads,
  head_size]`` (or ``[num_blocks, block_size, hidden]``), any strides (e.g. HND views);
- ``"flash_attn"``: vLLM v1's per-layer ``[2, num_blocks, block_size, heads, head_size]``;
- ``"flashinfer"``: vLLM v1's FlashInfer per-layer ``[num_blocks, 2, block_size, heads, head_size]``;
- ``"mla"``: one latent per token and layer (no K/V split): per-layer ``[num_blocks, block_size,
  latent]`` or ``[num_blocks, 1, block_size, latent]`` (vLLM-CPU) rows; one source per layer.

Token-major layout ``"token_major"`` (slot = token position): per-layer ``(K, V)``, each
``[T, hidden]``, ``[T, heads, head_size]`` or HF's ``[1, heads, T, head_size]`` (batch 1).

vLLM-CPU's packed blocks are not addressable per token this way; their connector
(`lmcache.integration.vllm.cpu_connector`) copies them itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lmcache.gpu_connector.sources import KVSources

PAGED_LAYOUTS = ("kv_tuples", "flash_attn", "flashinfer", "mla")


def infer_paged_layout(kvcaches: Any) -> str:
    """The paged layout of `kvcaches` from its form: tuples, or 5-D tensors with the K/V axis first
    (flash-attention) or second (FlashInfer; flash-attention wins when both dims are 2)."""
    layer = kvcaches[0]
    if isinstance(layer, (tuple, list)):
        return "kv_tuples"
    if isinstance(layer, torch.Tensor) and layer.dim() == 5:
        if layer.shape[0] == 2:
            return "flash_attn"
        if layer.shape[1] == 2:
            return "flashinfer"
    raise ValueError("kvcaches must be a sequence of per-layer (K, V) tuples or [2, num_blocks, "
                     "block_size, heads, head_size] / [num_blocks, 2, block_size, heads, head_size] "
                     f"tensors, got {type(layer).__name__} {tuple(getattr(layer, 'shape', ()))}")


def paged_sources(kvcaches: Any, layout: str, hidden: int, num_layers: int) -> KVSources:
    if layout == "mla":
        _check_layers(kvcaches, num_layers)
        return KVSources([_paged_view(_latent_rows(layer), hidden) for layer in kvcaches], hidden)
    split = _SPLITS.get(layout)
    if split is None:
        raise ValueError(f"unknown paged KV layout {layout!r}; expected one of {PAGED_LAYOUTS}")
    _check_layers(kvcaches, num_layers)
    pairs = [split(layer) for layer in kvcaches]
    return KVSources([_paged_view(p[i], hidden) for i in (0, 1) for p in pairs], hidden)


def token_major_sources(kvcaches: Any, hidden: int, num_layers: int,
                        heads: tuple[int, int] | None = None) -> KVSources:
    """`heads`: the expected (num_kv_heads, head_size), if known (sharper errors)."""
    if not isinstance(kvcaches, (list, tuple)) or len(kvcaches) != num_layers or not all(
            isinstance(layer, (tuple, list)) and len(layer) == 2 for layer in kvcaches):
        n = len(kvcaches) if hasattr(kvcaches, "__len__") else "?"
        raise ValueError(f"kvcaches must hold {num_layers} per-layer (K, V) pairs, got {n}")
    views = [_token_view(layer[i], hidden, heads) for i in (0, 1) for layer in kvcaches]
    lengths = {v.shape[0] for v in views}
    if len(lengths) > 1:
        raise ValueError(f"KV tensors of {sorted(lengths)} tokens cannot provide tokens of one sequence: "
                         "every layer's K and V must hold the same tokens")
    return KVSources(views, hidden)


def _check_layers(kvcaches: Any, num_layers: int) -> None:
    if not hasattr(kvcaches, "__len__") or len(kvcaches) != num_layers:
        n = len(kvcaches) if hasattr(kvcaches, "__len__") else "?"
        raise ValueError(f"kvcaches has {n} layers, expected {num_layers}")


def _pair(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(layer, (tuple, list)) and len(layer) == 2):
        raise ValueError(f"layout 'kv_tuples' needs per-layer (K, V) pairs, got {type(layer).__name__}")
    return layer[0], layer[1]


def _latent_rows(layer: Any) -> torch.Tensor:
    """[num_blocks, block_size, latent] of one layer's MLA cache."""
    if isinstance(layer, torch.Tensor) and layer.dim() == 4 and layer.shape[1] == 1:
        return layer[:, 0]
    if isinstance(layer, torch.Tensor) and layer.dim() == 3:
        return layer
    raise ValueError("layout 'mla' needs per-layer [num_blocks, block_size, latent] (or [num_blocks, 1, "
                     f"block_size, latent]) tensors, got {tuple(getattr(layer, 'shape', ()))}")


def _kv_axis(axis: int, name: str) -> Callable[[Any], tuple[torch.Tensor, torch.Tensor]]:
    def split(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(layer, torch.Tensor) or layer.dim() != 5 or layer.shape[axis] != 2:
            raise ValueError(f"layout {name!r} needs per-layer 5-D tensors with 2 (K, V) at dim {axis}, "
                             f"got {tuple(getattr(layer, 'shape', ()))}")
        return layer.select(axis, 0), layer.select(axis, 1)
    return split


_SPLITS: dict[str, Callable[[Any], tuple[torch.Tensor, torch.Tensor]]] = {
    "kv_tuples": _pair, "flash_attn": _kv_axis(0, "flash_attn"), "flashinfer": _kv_axis(1, "flashinfer"),
}


def _paged_view(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[num_blocks, block_size, heads, head_size] view of one paged K or V tensor."""
    if t.dim() == 3 and t.shape[2] == hidden:
        return t.unsqueeze(2)
    if t.dim() == 4 and t.shape[2] * t.shape[3] == hidden:
        return t
    raise ValueError(f"paged KV tensor of shape {tuple(t.shape)} is not [num_blocks, block_size, heads, "
                     f"head_size] with heads * head_size = {hidden}")


def _token_view(t: torch.Tensor, hidden: int, heads: tuple[int, int] | None) -> torch.Tensor:
    """[T, 1, heads, head_size] view of one token-major or HF K or V tensor."""
    if t.dim() == 4:
        h, d = heads or (t.shape[1], t.shape[3])
        if t.shape[0] != 1 or t.shape[1] != h or t.shape[3] != d or h * d != hidden:
            raise ValueError(f"HF KV tensor of shape {tuple(t.shape)}: expected [1, {h}, T, {d}] "
                             f"with {h} * {d} = {hidden}")
        return t[0].transpose(0, 1).unsqueeze(1)
    if t.dim() == 3 and t.shape[1] * t.shape[2] == hidden:
        return t.unsqueeze(1)
    if t.dim() == 2 and t.shape[1] == hidden:
        return t[:, None, None, :]
    raise ValueError(f"KV tensor of shape {tuple(t.shape)} cannot provide tokens as [T, {hidden}], "
                     f"[T, heads, head_size] or [1, heads, T, head_size] with heads * head_size = {hidden}")
