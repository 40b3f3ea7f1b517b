"""`TokenMajorConnector` (seed name `VLLMNestedTupleGPUConnector`): per-layer tensors that hold the
whole token sequence, one token after another.

``kvcaches`` = one ``(K, V)`` pair per layer, each ``[T, hidden]``, ``[T, heads, head_size]`` or
HF transformers' ``[1, heads, T, head_size]`` (a `DynamicCache` layer, batch 1); the form is read
from each tensor's rank. Token ``i`` of the sequence is row ``i``: the connector is a paged one
with block size 1 and slot = token position, so it shares every copy path (native, staged with
its CUDA pipeline, torch) with `VLLMPagedMemGPUConnector`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache.gpu_connector.layouts import token_major_sources
from lmcache.gpu_connector.paged import PagedConnector
from lmcache.gpu_connector.sources import KVSources


class TokenMajorConnector(PagedConnector):
    """`num_kv_heads` / `head_size`: the expected head split of HF tensors, if known."""

    reuses_caches = False  # a model's KV tensors grow (new tensors) with every forward

    def __init__(self, hidden_dim_size: int, num_layers: int, *, num_kv_heads: int | None = None,
                 head_size: int | None = None, **options: Any) -> None:
        super().__init__(hidden_dim_size, num_layers, **options)
        self._heads: tuple[int, int] | None = None
        if num_kv_heads is not None or head_size is not None:
            if num_kv_heads is None or head_size is None or num_kv_heads * head_size != hidden_dim_size:
                raise ValueError(f"num_kv_heads={num_kv_heads} x head_size={head_size} must both be given "
                                 f"and multiply to hidden_dim_size={hidden_dim_size}, or neither")
            self._heads = (num_kv_heads, head_size)

    def _make_sources(self, kvcaches: Any) -> KVSources:
        return token_major_sources(kvcaches, self.hidden_dim_size, self.num_layers, self._heads)

    def _token_slots(self, kwargs: dict[str, Any], starts: Sequence[int], ends: Sequence[int],
                     target: KVSources) -> torch.Tensor:
        if max(ends) > target.num_slots:
            shape = tuple(target.tensors[0].shape)
            raise ValueError(f"KV tensors of {target.num_slots} tokens (source view {shape}) cannot "
                             f"provide tokens [{min(starts)}, {max(ends)})")
        consecutive = all(ends[i] == starts[i + 1] for i in range(len(starts) - 1))
        if consecutive:
            return torch.arange(starts[0], ends[-1], dtype=torch.int64)
        return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in zip(starts, ends, strict=True)])


VLLMNestedTupleGPUConnector = TokenMajorConnector
