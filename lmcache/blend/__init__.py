"""CacheBlend (seed 001): reuse the KV of text that is not a prefix (e.g. retrieved passages in any
order), recomputing only the tokens whose KV deviates most, with RoPE positions corrected.

- `interfaces`: `BlendExecutor`, `BlendOutput`, `BlendRetriever`, `BlendRetrieverTask`,
  `BlendRetrieverResult`.
- `executor`: `CacheBlendImpl` (token selection and KV blending) and index helpers.
- `retriever`: `SPTBlendRetriever` (per-segment, position-independent, asynchronous loads).

The layer-by-layer forward that drives them for HF Llama-family models lives in
`lmcache.integration.transformers`.
"""

from lmcache.blend.executor import CacheBlendImpl, create_index, indices_to_mask, mask_to_indices
from lmcache.blend.interfaces import (
    BlendExecutor,
    BlendOutput,
    BlendRetriever,
    BlendRetrieverResult,
    BlendRetrieverTask,
    PositionalEncoder,
)
from lmcache.blend.retriever import SPTBlendRetriever, SPTBlendRetrieverTask, split_segments

__all__ = [
    "BlendExecutor", "BlendOutput", "BlendRetriever", "BlendRetrieverResult", "BlendRetrieverTask",
    "CacheBlendImpl", "PositionalEncoder", "SPTBlendRetriever", "SPTBlendRetrieverTask",
    "create_index", "indices_to_mask", "mask_to_indices", "split_segments",
]
