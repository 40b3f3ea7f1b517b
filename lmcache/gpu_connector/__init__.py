"""GPU connectors: copy KV between a serving engine's cache and `KV_BLOB` memory objects, one
batched copy per request.

- `interface`: the connector contract (`GPUConnectorInterface`, `CopyDone`, `finish`).
- `batched`: `BatchedKVConnector`, the request-level base (object and slot checks, the
  negative-slot rule, synchronous single-object calls).
- `layouts` / `sources`: the cache layouts (paged flash-attention / FlashInfer / (K, V) tuples,
  token-major / HF) as `KVSources`, 2 * num_layers tensors addressed by slot.
- `paged`: `PagedConnector` (path choice: staged / native / torch) and the seed's
  `VLLMPagedMemGPUConnector`, `VLLMPagedMemGPUConnectorV2`.
- `token_major`: `TokenMajorConnector` = the seed's `VLLMNestedTupleGPUConnector` (and the base
  of the transformers integration's `HFKVConnector`).
- `spans`, `staged`, `completion`, `torch_rows`, `triton_rows`: the request's memory pieces, the
  CUDA staging pipeline, its completion thread, and the two row kernels.

vLLM-CPU's packed blocks have their own connector in `lmcache.integration.vllm.cpu_connector`.
"""

from lmcache.gpu_connector.batched import BatchedKVConnector, CopyRequest
from lmcache.gpu_connector.interface import (
    CopyDone,
    GPUConnectorInterface,
    KVBlobConnector,
    finish,
    require_kvcaches,
    require_slot_mapping,
)
from lmcache.gpu_connector.layouts import PAGED_LAYOUTS
from lmcache.gpu_connector.paged import (
    PagedConnector,
    VLLMPagedMemGPUConnector,
    VLLMPagedMemGPUConnectorV2,
)
from lmcache.gpu_connector.token_major import TokenMajorConnector, VLLMNestedTupleGPUConnector

__all__ = [
    "PAGED_LAYOUTS", "BatchedKVConnector", "CopyDone", "CopyRequest", "GPUConnectorInterface",
    "KVBlobConnector", "PagedConnector", "TokenMajorConnector", "VLLMNestedTupleGPUConnector",
    "VLLMPagedMemGPUConnector", "VLLMPagedMemGPUConnectorV2", "finish", "require_kvcaches",
    "require_slot_mapping",
]
