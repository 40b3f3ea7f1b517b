"""`HFKVConnector`: copies KV between `KV_BLOB` memory objects and per-layer HF tensors.

`kvcaches` = one ``(K, V)`` pair per layer, each either

- HF's `DynamicCache` layout ``[1, num_kv_heads, T, head_size]`` (batch 1, post-RoPE keys), or
- token-major ``[T, num_kv_heads * head_size]`` / ``[T, num_kv_heads, head_size]``

(the layout is read from each tensor's rank). Every token range is copied through strided views —
one copy, no intermediate buffer — so `to_gpu` writes straight into the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache.gpu_connector import KVBlobConnector, require_kvcaches
from lmcache.memory_management import MemoryObj


class HFKVConnector(KVBlobConnector):
    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        super().__init__(num_kv_heads * head_size, num_layers)
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size

    def _token_view(self, t: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Tokens [start, end) of one K or V tensor as a ``[n, num_kv_heads, head_size]`` view."""
        h, d = self.num_kv_heads, self.head_size
        if t.dtype != dtype:
            raise ValueError(f"KV dtype {t.dtype} does not match memory object dtype {dtype}")
        if t.dim() == 4:
            if t.shape[0] != 1 or t.shape[1] != h or t.shape[3] != d or t.shape[2] < end:
                raise ValueError(f"HF KV tensor of shape {tuple(t.shape)} cannot provide tokens "
                                 f"[{start}, {end}); expected [1, {h}, >= {end}, {d}]")
            return t[0, :, start:end].transpose(0, 1)
        if t.dim() in (2, 3) and t.shape[0] >= end and t[0].numel() == h * d:
            try:
                return t[start:end].view(end - start, h, d)
            except RuntimeError as e:
                raise ValueError(f"token-major KV tensor of shape {tuple(t.shape)} and strides "
                                 f"{t.stride()} cannot be viewed per token: {e}") from e
        raise ValueError(f"KV tensor of shape {tuple(t.shape)} cannot provide tokens [{start}, {end}) "
                         f"as [1, {h}, T, {d}] or [T, {h * d}]")

    def _views(self, kvcaches: Sequence[Sequence[torch.Tensor]], start: int, end: int,
               dtype: torch.dtype) -> list[torch.Tensor]:
        if len(kvcaches) != self.num_layers or not all(len(layer) == 2 for layer in kvcaches):
            raise ValueError(f"kvcaches must hold {self.num_layers} per-layer (K, V) pairs, "
                             f"got {len(kvcaches)}")
        return [self._token_view(layer[i], start, end, dtype) for i in (0, 1) for layer in kvcaches]

    def _blob_views(self, blob: torch.Tensor) -> list[torch.Tensor]:
        n = blob.shape[2]
        return [t.view(n, self.num_kv_heads, self.head_size) for t in blob.flatten(0, 1).unbind(0)]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        blob = self.blob_of(memory_obj, start, end, set_fmt=True)
        kv = self._views(require_kvcaches(kwargs), start, end, blob.dtype)
        torch._foreach_copy_(self._blob_views(blob), kv)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        blob = self.blob_of(memory_obj, start, end, set_fmt=False)
        kv = self._views(require_kvcaches(kwargs), start, end, blob.dtype)
        torch._foreach_copy_(kv, self._blob_views(blob))

