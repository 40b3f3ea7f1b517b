"""`HFKVConnector`: the token-major connector with HF transformers' signature.

`kvcaches` = one ``(K, V)`` pair per layer, each either HF's `DynamicCache` layout ``[1,
num_kv_heads, T, head_size]`` (batch 1, post-RoPE keys) or token-major ``[T, num_kv_heads *
head_size]`` / ``[T, num_kv_heads, head_size]`` (read from each tensor's rank). It is
`lmcache.gpu_connector.TokenMajorConnector` (one batched copy per request: strided copies on the
CPU, the staged event-ordered pipeline on CUDA) told the model's head split.
"""

from __future__ import annotations

from typing import Any

from lmcache.gpu_connector import TokenMajorConnector


class HFKVConnector(TokenMajorConnector):
    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, **options: Any) -> None:
        super().__init__(num_kv_heads * head_size, num_layers, num_kv_heads=num_kv_heads,
                         head_size=head_size, **options)
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
