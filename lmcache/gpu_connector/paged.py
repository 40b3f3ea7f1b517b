"""`PagedConnector`: the base of connectors whose caches resolve to `KVSources`, and the paged ones.

Per request it picks one of three paths, each ONE batched copy of all chunks:

- staged (`staged.StagedCopier`): caches on a CUDA device (asynchronous, event-ordered, at the
  PCIe limit), or any device when forced (``staged=True`` or ``LMCACHE_STAGED_COPY=1``), where it
  runs synchronously;
- native (`lmcache.native`): CPU caches of contiguous rows; one C call moves every run of
  consecutive slots with one memcpy;
- torch (`torch_rows`): CPU caches the native kernel cannot read (strided / FlashInfer / HF) or no
  compiler; the rows go straight into the objects.

The sources of the last caches seen are cached (vLLM passes the same per-layer tensors every step).

- `VLLMPagedMemGPUConnector` / `VLLMPagedMemGPUConnectorV2` (seed names; V2 adds `use_gpu`):
  ``kvcaches`` in one of `layouts.PAGED_LAYOUTS` (named by `layout`, or inferred from the form),
  ``slot_mapping`` = slot of every token of the whole sequence. See `batched` for negative slots.
"""

from __future__ import annotations

import abc
import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from lmcache import native
from lmcache.gpu_connector.batched import BatchedKVConnector, CopyRequest, slots_from_mapping
from lmcache.gpu_connector.interface import CopyDone, finish
from lmcache.gpu_connector.layouts import infer_paged_layout, paged_sources
from lmcache.gpu_connector.sources import KVSources
from lmcache.gpu_connector.spans import plan_pieces
from lmcache.gpu_connector.staged import DEFAULT_PIECE_BYTES, DEFAULT_STAGING_BYTES, StagedCopier
from lmcache.gpu_connector.torch_rows import copy_piece_torch

STAGED_ENV = "LMCACHE_STAGED_COPY"


def staged_by_default() -> bool:
    """``LMCACHE_STAGED_COPY=1``: force the staged path for CPU caches too."""
    return os.environ.get(STAGED_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


class PagedConnector(BatchedKVConnector):
    """`use_native`: use the native CPU kernel where it applies. `staged`: force the staged path
    for CPU caches (default from ``LMCACHE_STAGED_COPY``; CUDA caches always use it).
    `staged_kernel`: "auto" (Triton on CUDA), "triton" or "torch". `staging_bytes`: bound of the
    staging memory per device; `piece_bytes`: the unit of pipelining (one DMA each)."""

    reuses_caches = True
    """Whether callers pass the same cache tensors call after call (worth caching their sources)."""

    def __init__(self, hidden_dim_size: int, num_layers: int, *, use_native: bool = True,
                 staged: bool | None = None, staged_kernel: str = "auto",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 kv_count: int = 2) -> None:
        super().__init__(hidden_dim_size, num_layers, kv_count=kv_count)
        self._native = native.load() if use_native else None
        self.staged = staged_by_default() if staged is None else staged
        self._staged_kernel = staged_kernel
        self._staging_bytes, self._piece_bytes = staging_bytes, piece_bytes
        self._copiers: dict[torch.device, StagedCopier] = {}
        self._copiers_lock = threading.Lock()
        self._sources: tuple[tuple[Any, ...], KVSources] | None = None

    @abc.abstractmethod
    def _make_sources(self, kvcaches: Any) -> KVSources:
        """`kvcaches` in this connector's layout as sources; ValueError if they are not."""

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every copy issued so far has completed and its `on_done` ran."""
        with self._copiers_lock:
            copiers = list(self._copiers.values())
        return all(c.drain(timeout) for c in copiers)

    def staged_copier(self, device: torch.device) -> StagedCopier:
        """This connector's staged copier for caches on `device` (one per device, made on first use)."""
        with self._copiers_lock:
            copier = self._copiers.get(device)
            if copier is None:
                copier = StagedCopier(device, staging_bytes=self._staging_bytes,
                                      piece_bytes=self._piece_bytes, kernel=self._staged_kernel)
                self._copiers[device] = copier
            return copier

    def _target(self, kvcaches: Any, dtype: torch.dtype) -> KVSources:
        key = _identity(kvcaches) if self.reuses_caches else None
        if self._sources is not None and key is not None and self._sources[0] == key:
            sources = self._sources[1]
        else:
            sources = self._make_sources(kvcaches)
            if key is not None:
                self._sources = (key, sources)
        if sources.dtype != dtype:
            raise ValueError(f"KV dtype {sources.dtype} does not match memory object dtype {dtype}")
        return sources

    def _copy(self, target: KVSources, request: CopyRequest, on_done: CopyDone) -> None:
        if target.device.type != "cpu" or self.staged:
            self.staged_copier(target.device).copy(target, request, on_done)
            return
        if (self._native is not None and target.native_ptrs is not None
                and all(b.device.type == "cpu" for b in request.blobs)):
            self._copy_native(target, request)
        else:
            for piece in plan_pieces(request.objs, request.blobs, request.bounds):
                copy_piece_torch(request.gather, target, piece, piece.memory, request.slots, request.slots)
        finish(on_done)

    def _copy_native(self, sources: KVSources, request: CopyRequest) -> None:
        assert self._native is not None and sources.native_ptrs is not None
        bounds = torch.tensor(request.bounds, dtype=torch.int64)
        bufs = torch.tensor([b.data_ptr() for b in request.blobs], dtype=torch.int64)
        rc = self._native.lmc_paged_copy(
            ctypes.c_void_p(sources.native_ptrs.data_ptr()), sources.num_sources, sources.num_slots,
            ctypes.c_void_p(request.slots.data_ptr()), ctypes.c_void_p(bounds.data_ptr()),
            ctypes.c_void_p(bufs.data_ptr()), request.num_chunks,
            sources.hidden * sources.dtype.itemsize, 0 if request.gather else 1, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native paged copy failed (code {rc}) on slots checked in range")


class VLLMPagedMemGPUConnector(PagedConnector):
    """Paged caches: per-layer ``(K, V)`` tuples of ``[num_blocks, block_size, num_heads,
    head_size]``, vLLM v1's per-layer ``[2, num_blocks, block_size, num_heads, head_size]``
    (flash-attention) or ``[num_blocks, 2, block_size, num_heads, head_size]`` (FlashInfer), or
    MLA's per-layer latent rows (``layout="mla"``: `hidden_dim_size` is the latent width and the
    objects are ``[1, num_layers, tokens, latent]``). `layout`: one of `layouts.PAGED_LAYOUTS`, or
    None to infer a K/V layout from each call's caches."""

    def __init__(self, hidden_dim_size: int, num_layers: int, *, layout: str | None = None,
                 **options: Any) -> None:
        super().__init__(hidden_dim_size, num_layers, kv_count=1 if layout == "mla" else 2, **options)
        self.layout = layout

    def _make_sources(self, kvcaches: Any) -> KVSources:
        if not isinstance(kvcaches, (list, tuple)) or not kvcaches:
            raise ValueError("kvcaches must be a non-empty per-layer sequence, got "
                             f"{type(kvcaches).__name__}")
        layout = self.layout or infer_paged_layout(kvcaches)
        return paged_sources(kvcaches, layout, self.hidden_dim_size, self.num_layers)

    def _token_slots(self, kwargs: dict[str, Any], starts: Sequence[int], ends: Sequence[int],
                     target: KVSources) -> torch.Tensor:
        slots = slots_from_mapping(kwargs, starts, ends)
        if slots.dim() != 1:
            raise ValueError(f"slot_mapping of shape {tuple(slots.shape)}: this connector's layers belong "
                             "to one KV cache group, one slot row ([T])")
        return slots


class VLLMPagedMemGPUConnectorV2(VLLMPagedMemGPUConnector):
    """`VLLMPagedMemGPUConnector` with the seed's signature. `use_gpu` is accepted for it: copies
    of caches on a GPU always stage through the GPU (see `staged`)."""

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(hidden_dim_size, num_layers, **kwargs)
        self.use_gpu = use_gpu


def _identity(kvcaches: Any) -> tuple[Any, ...] | None:
    """What makes two calls' caches the same for the sources cache (None: do not cache)."""
    try:
        ends = [kvcaches[0], kvcaches[-1]]
        tensors = [t if isinstance(t, torch.Tensor) else t[0] for t in ends]
        return (id(kvcaches), len(kvcaches),
                *((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors))
    except (TypeError, IndexError, KeyError, AttributeError):
        return None
