"""GPU connectors: copy KV between a serving engine's cache and `KV_BLOB` memory objects.

A `KV_BLOB` object holds ``[2, num_layers, num_tokens, hidden_dim]`` (K then V, token-major).
`from_gpu(obj, start, end, **kw)` fills the object with tokens ``[start, end)`` of the engine's
cache; `to_gpu` writes them back. "GPU" is the seed's name: every connector is device-agnostic and
works on CPU tensors too.

- `VLLMNestedTupleGPUConnector`: ``kvcaches`` = per-layer ``(K, V)``, each ``[num_tokens, ...]``
  (token dimension 0, e.g. ``[num_tokens, hidden]`` or ``[num_tokens, num_heads, head_size]``).
- `VLLMPagedMemGPUConnector` and `VLLMPagedMemGPUConnectorV2` (the same copies; V2 has the
  seed's `use_gpu` argument): ``kvcaches`` = per-layer ``(K, V)``, each ``[num_blocks,
  block_size, num_heads, head_size]``, or vLLM v1's per-layer ``[2, num_blocks, block_size,
  num_heads, head_size]`` tensors; ``slot_mapping`` = slot of every token of the whole sequence
  (slot = block_id * block_size + offset). The slot mapping may start with -1 for a prefix the
  engine already has, and ``[start, end)`` must not overlap that prefix.

On CPU the paged copies go through a native kernel that moves each run of consecutive slots with
one memcpy (`lmcache.native`); elsewhere, or without a compiler, through torch indexing ops.
"""

from __future__ import annotations

import abc
import ctypes
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache import native
from lmcache.memory_management import MemoryFormat, MemoryObj

_GATHER, _SCATTER = 0, 1

CopyDone = Callable[[BaseException | None], None]
"""Called once a batched copy has completed (None) or failed after it was issued (the error)."""


def finish(on_done: CopyDone | None) -> None:
    """Report a synchronous copy as completed."""
    if on_done is not None:
        on_done(None)


class GPUConnectorInterface(abc.ABC):
    @abc.abstractmethod
    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens [start, end) of the engine's KV cache into `memory_obj`."""

    @abc.abstractmethod
    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy `memory_obj` into tokens [start, end) of the engine's KV cache."""

    @abc.abstractmethod
    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of the memory object holding `num_tokens` tokens."""

    def batched_from_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                         ends: Sequence[int], *, on_done: CopyDone | None = None, **kwargs: Any) -> None:
        """`from_gpu` for several (object, start, end) at once; a connector may copy them in one
        go. Returns once the copy is issued; `on_done(error)` runs exactly once, when the copy has
        completed (a synchronous connector calls it before returning; an asynchronous one later,
        possibly on another thread): until then the objects may be incomplete. If this raises,
        nothing is in flight and `on_done` is not called (any object may be incomplete)."""
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)
        finish(on_done)

    def batched_to_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                       ends: Sequence[int], *, on_done: CopyDone | None = None, **kwargs: Any) -> None:
        """`to_gpu` for several (object, start, end) at once, with `batched_from_gpu`'s contract:
        the objects must stay valid until `on_done` ran. If this raises, any of the token ranges
        may be partly written."""
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)
        finish(on_done)


class KVBlobConnector(GPUConnectorInterface):
    """Base of connectors that produce/consume [2, num_layers, num_tokens, hidden] KV blobs."""

    def __init__(self, hidden_dim_size: int, num_layers: int) -> None:
        if hidden_dim_size <= 0 or num_layers <= 0:
            raise ValueError(f"hidden_dim_size={hidden_dim_size} and num_layers={num_layers} must be > 0")
        self.hidden_dim_size = hidden_dim_size
        self.num_layers = num_layers

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    def blob_of(self, memory_obj: MemoryObj, start: int, end: int, *, set_fmt: bool) -> torch.Tensor:
        """The object's tensor, checked to be a [2, L, end - start, hidden] KV blob."""
        tensor = memory_obj.tensor
        assert tensor is not None, "memory object has no tensor"
        if set_fmt and memory_obj.get_memory_format() == MemoryFormat.UNDEFINED:
            memory_obj.metadata.fmt = MemoryFormat.KV_BLOB
        if memory_obj.get_memory_format() != MemoryFormat.KV_BLOB:
            raise ValueError(f"memory object format is {memory_obj.get_memory_format()}, expected KV_BLOB")
        if not 0 <= start < end:
            raise ValueError(f"invalid token range [{start}, {end})")
        if tuple(tensor.shape) != tuple(self.get_shape(end - start)):
            raise ValueError(f"memory object shape {tuple(tensor.shape)} does not hold tokens "
                             f"[{start}, {end}); expected {tuple(self.get_shape(end - start))}")
        return tensor


def require_kvcaches(kwargs: dict[str, Any]) -> Any:
    if "kvcaches" not in kwargs:
        raise ValueError("'kvcaches' should be provided in kwargs")
    return kwargs["kvcaches"]


def require_slot_mapping(kwargs: dict[str, Any]) -> torch.Tensor:
    if "slot_mapping" not in kwargs:
        raise ValueError("'slot_mapping' should be provided in kwargs")
    return kwargs["slot_mapping"]


class VLLMNestedTupleGPUConnector(KVBlobConnector):
    """Per-layer ``(K, V)`` tensors with the token dimension first, covering the whole sequence."""

    def _layers(self, kvcaches: Sequence[Sequence[torch.Tensor]], start: int, end: int,
                dtype: torch.dtype) -> list[torch.Tensor]:
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"kvcaches has {len(kvcaches)} layers, expected {self.num_layers}")
        views = []
        for i in (0, 1):
            for layer in kvcaches:
                t = layer[i]
                if t.shape[0] < end or t[0].numel() != self.hidden_dim_size:
                    raise ValueError(f"KV tensor of shape {tuple(t.shape)} cannot provide tokens "
                                     f"[{start}, {end}) with hidden size {self.hidden_dim_size}")
                if t.dtype != dtype:
                    raise ValueError(f"KV dtype {t.dtype} does not match memory object dtype {dtype}")
                views.append(t[start:end].reshape(end - start, self.hidden_dim_size))
        return views

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        blob = self.blob_of(memory_obj, start, end, set_fmt=True)
        srcs = self._layers(require_kvcaches(kwargs), start, end, blob.dtype)
        torch._foreach_copy_(list(blob.flatten(0, 1).unbind(0)), srcs)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        blob = self.blob_of(memory_obj, start, end, set_fmt=False)
        dsts = self._layers(require_kvcaches(kwargs), start, end, blob.dtype)
        torch._foreach_copy_(dsts, list(blob.flatten(0, 1).unbind(0)))


class _PagedSources:
    """The 2 * num_layers paged tensors (all K, then all V), each ``[num_blocks, block_size, ...]``
    with `hidden` values per token in any strides (flash-attention, FlashInfer and HND layouts
    alike); the native path additionally needs them contiguous."""

    def __init__(self, tensors: list[torch.Tensor], hidden: int) -> None:
        first = tensors[0]
        if first.dim() < 3:
            raise ValueError("paged KV tensors must be [num_blocks, block_size, ...], "
                             f"got {tuple(first.shape)}")
        self.tensors = tensors
        self.device, self.dtype = first.device, first.dtype
        self.num_blocks, self.block_size = first.shape[0], first.shape[1]
        self.num_slots = self.num_blocks * self.block_size
        for t in tensors:
            if (t.shape != first.shape or t[0, 0].numel() != hidden or t.dtype != self.dtype
                    or t.device != self.device):
                raise ValueError("paged KV tensors must all be [num_blocks, block_size, ...] with "
                                 f"{hidden} values per token and one dtype/device, got "
                                 f"{tuple(t.shape)} {t.dtype} {t.device}")
        self.native_ok = self.device.type == "cpu" and all(t.is_contiguous() for t in tensors)
        self.ptrs = (torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
                     if self.native_ok else None)


class VLLMPagedMemGPUConnector(KVBlobConnector):
    """Paged per-layer ``(K, V)`` tuples of ``[num_blocks, block_size, num_heads, head_size]``,
    or per-layer ``[2, num_blocks, block_size, num_heads, head_size]`` tensors (vLLM v1)."""

    def __init__(self, hidden_dim_size: int, num_layers: int, *, use_native: bool = True) -> None:
        super().__init__(hidden_dim_size, num_layers)
        self._native = native.load() if use_native else None
        self._sources_cache: tuple[tuple[int, ...], _PagedSources] | None = None

    def _split(self, kvcaches: Any) -> list[torch.Tensor]:
        """All K tensors then all V tensors."""
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"kvcaches has {len(kvcaches)} layers, expected {self.num_layers}")
        if not all((isinstance(layer, (tuple, list)) and len(layer) == 2)
                   or (isinstance(layer, torch.Tensor) and layer.dim() >= 2 and layer.shape[0] == 2)
                   for layer in kvcaches):
            raise ValueError("kvcaches must be a sequence of per-layer (K, V) tuples or "
                             "[2, num_blocks, block_size, ...] tensors")
        return [layer[0] for layer in kvcaches] + [layer[1] for layer in kvcaches]

    def _sources(self, kvcaches: Any) -> _PagedSources:
        ident = (id(kvcaches), len(kvcaches), _first_ptr(kvcaches[0]), _first_ptr(kvcaches[-1]))
        cached = self._sources_cache
        if cached is not None and cached[0] == ident:
            return cached[1]
        sources = _PagedSources(self._split(kvcaches), self.hidden_dim_size)
        self._sources_cache = (ident, sources)
        return sources

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self._copy([memory_obj], [start], [end], kwargs, _GATHER)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self._copy([memory_obj], [start], [end], kwargs, _SCATTER)

    def batched_from_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                         ends: Sequence[int], *, on_done: CopyDone | None = None, **kwargs: Any) -> None:
        self._copy(memory_objs, starts, ends, kwargs, _GATHER)
        finish(on_done)

    def batched_to_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                       ends: Sequence[int], *, on_done: CopyDone | None = None, **kwargs: Any) -> None:
        self._copy(memory_objs, starts, ends, kwargs, _SCATTER)
        finish(on_done)

    def _copy(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int],
              kwargs: dict[str, Any], direction: int) -> None:
        if not memory_objs:
            return
        blobs = [self.blob_of(obj, start, end, set_fmt=direction == _GATHER)
                 for obj, start, end in zip(memory_objs, starts, ends, strict=True)]
        src = self._sources(require_kvcaches(kwargs))
        slot_mapping = require_slot_mapping(kwargs)
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] < max(ends):
            raise ValueError(f"slot_mapping of shape {tuple(slot_mapping.shape)} does not cover "
                             f"tokens [{min(starts)}, {max(ends)})")
        if any(b.dtype != src.dtype for b in blobs):
            raise ValueError(f"KV dtype {src.dtype} does not match memory object dtype {blobs[0].dtype}")
        if self._native is not None and src.native_ok and all(
                b.device.type == "cpu" and b.is_contiguous() for b in blobs):
            self._copy_native(src, slot_mapping, blobs, starts, ends, direction)
        else:
            for blob, start, end in zip(blobs, starts, ends, strict=True):
                self._copy_torch(src, slot_mapping[start:end], blob, direction)

    def _copy_native(self, src: _PagedSources, slot_mapping: torch.Tensor, blobs: list[torch.Tensor],
                     starts: Sequence[int], ends: Sequence[int], direction: int) -> None:
        assert self._native is not None and src.ptrs is not None
        consecutive = all(ends[i] == starts[i + 1] for i in range(len(starts) - 1))
        if consecutive:
            slots = slot_mapping[starts[0]: ends[-1]]
        else:
            slots = torch.cat([slot_mapping[a:b] for a, b in zip(starts, ends, strict=True)])
        slots = slots.to("cpu", torch.int64).contiguous()
        offsets = torch.tensor([0, *itertools.accumulate(e - s for s, e in zip(starts, ends, strict=True))],
                               dtype=torch.int64)
        bufs = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64)
        rc = self._native.lmc_paged_copy(
            ctypes.c_void_p(src.ptrs.data_ptr()), len(src.tensors), src.num_slots,
            ctypes.c_void_p(slots.data_ptr()), ctypes.c_void_p(offsets.data_ptr()),
            ctypes.c_void_p(bufs.data_ptr()), len(blobs), self.hidden_dim_size * blobs[0].element_size(),
            direction, torch.get_num_threads(),
        )
        if rc != 0:
            self._raise_bad_slots(slots, src.num_slots)

    def _copy_torch(self, src: _PagedSources, slots: torch.Tensor, blob: torch.Tensor,
                    direction: int) -> None:
        slots = slots.to(src.device, torch.int64)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= src.num_slots):
            self._raise_bad_slots(slots, src.num_slots)
        block, offset = slots // src.block_size, slots % src.block_size
        rows = blob.flatten(0, 1)  # [2L, n, hidden]
        if direction == _GATHER:
            staging = rows if rows.device == src.device else torch.empty(
                rows.shape, dtype=rows.dtype, device=src.device)
            for i, t in enumerate(src.tensors):
                staging[i] = t[block, offset].reshape(-1, staging.shape[-1])
            if staging is not rows:
                rows.copy_(staging)
        else:
            data = rows.to(src.device, non_blocking=True)
            for i, t in enumerate(src.tensors):
                t.index_put_((block, offset), data[i].view(-1, *t.shape[2:]))

    @staticmethod
    def _raise_bad_slots(slots: torch.Tensor, num_slots: int) -> None:
        bad = slots[(slots < 0) | (slots >= num_slots)]
        raise ValueError(f"slot_mapping holds {bad.numel()} slot(s) outside [0, {num_slots}) in the "
                         f"requested range (e.g. {int(bad[0])}); a -1 marks a prefix the engine "
                         "already has and must not be inside [start, end)")


class VLLMPagedMemGPUConnectorV2(VLLMPagedMemGPUConnector):
    """`VLLMPagedMemGPUConnector` with the seed's signature. `use_gpu` is accepted for it;
    staging happens on the cache's device whenever the cache is not on the CPU."""

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(hidden_dim_size, num_layers, use_native=kwargs.pop("use_native", True))
        self.use_gpu = use_gpu


def _first_ptr(layer: Any) -> int:
    t = layer if isinstance(layer, torch.Tensor) else layer[0]
    return int(t.data_ptr())
