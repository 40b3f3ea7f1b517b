"""The connector interface: copy KV between a serving engine's cache and `KV_BLOB` memory objects.

A `KV_BLOB` object holds ``[2, num_layers, num_tokens, hidden_dim]`` (K then V, token-major), or
``[1, num_layers, num_tokens, latent]`` for a model with one latent per token and layer (MLA).
`from_gpu(obj, start, end, **kw)` fills the object with tokens ``[start, end)`` of the engine's
cache; `to_gpu` writes them back. The batched forms take every chunk of a request at once and may
complete asynchronously (`CopyDone`). "GPU" is the seed's name: connectors work on CPU tensors too.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache.memory_management import MemoryFormat, MemoryObj

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
    """Base of connectors that produce/consume [kv_count, num_layers, num_tokens, hidden] KV blobs
    (`kv_count` 2: K and V; 1: one MLA latent of `hidden_dim_size` values per token and layer)."""

    def __init__(self, hidden_dim_size: int, num_layers: int, *, kv_count: int = 2) -> None:
        if hidden_dim_size <= 0 or num_layers <= 0:
            raise ValueError(f"hidden_dim_size={hidden_dim_size} and num_layers={num_layers} must be > 0")
        if kv_count not in (1, 2):
            raise ValueError(f"kv_count={kv_count} must be 2 (K and V) or 1 (an MLA latent)")
        self.hidden_dim_size = hidden_dim_size
        self.num_layers = num_layers
        self.kv_count = kv_count

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([self.kv_count, self.num_layers, num_tokens, self.hidden_dim_size])

    def blob_of(self, memory_obj: MemoryObj, start: int, end: int, *, set_fmt: bool) -> torch.Tensor:
        """The object's tensor, checked to be a contiguous [2, L, end - start, hidden] KV blob."""
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
        if not tensor.is_contiguous():
            raise ValueError("memory object tensor is not contiguous")
        return tensor


def require_kvcaches(kwargs: dict[str, Any]) -> Any:
    if "kvcaches" not in kwargs:
        raise ValueError("'kvcaches' should be provided in kwargs")
    return kwargs["kvcaches"]


def require_slot_mapping(kwargs: dict[str, Any]) -> torch.Tensor:
    if "slot_mapping" not in kwargs:
        raise ValueError("'slot_mapping' should be provided in kwargs")
    return kwargs["slot_mapping"]
