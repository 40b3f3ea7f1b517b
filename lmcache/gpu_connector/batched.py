"""`BatchedKVConnector`: the request-level base of every KV_BLOB connector.

One store or retrieve is one `CopyRequest`: every chunk object of the request, the token range
each holds, and the slot of every token in the engine's cache. The base checks the objects and
the slots once for the whole request and hands it to the subclass's `_copy` (one batched copy per
request, whatever the layout); the single-object `from_gpu` / `to_gpu` of the seed are requests of
one chunk that wait for their copy.

Slots. ``slot = block_id * block_size + offset``; a slot at or beyond the cache's end is a
ValueError. A negative slot marks a token whose KV the serving engine already holds (its own
prefix cache is block-aligned, 16 or 128 tokens, while LMCache chunks are 256): a store rejects it
(ValueError: there is nothing to store), a retrieve skips it and leaves that token's KV untouched.
This deviates on purpose from seed 000, which says such a range "should NEVER overlap" the -1
prefix: vLLM's worker loads whole chunks and marks the tokens it already holds with -1 inside the
first one.

Subclasses provide `_target` (the engine's caches resolved for copying, with ``num_slots``),
`_token_slots` (slots of the request's tokens) and `_copy`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lmcache.gpu_connector.interface import (
    CopyDone,
    KVBlobConnector,
    require_kvcaches,
    require_slot_mapping,
)
from lmcache.memory_management import MemoryObj


class CopyTarget(Protocol):
    """The engine's caches as a connector resolved them."""

    num_slots: int
    dtype: torch.dtype


@dataclass(frozen=True)
class CopyRequest:
    """One store (``gather``: engine cache -> objects) or retrieve (scatter) of a whole request.

    blobs: each chunk object's ``[2, L, n_c, hidden]`` tensor, in request order (contiguous).
    slots: ``[N]`` int64 on the CPU, the slot of every token, chunk after chunk (< 0: skip); or
    ``[G, N]``, one row per KV cache group, for a connector whose layers belong to several groups
    (a gather stores zeros for a token a group does not hold).
    bounds: ``[C + 1]`` offsets of each chunk's first token in `slots`."""

    gather: bool
    objs: Sequence[MemoryObj]
    blobs: list[torch.Tensor]
    slots: torch.Tensor
    bounds: list[int]

    @property
    def num_chunks(self) -> int:
        return len(self.blobs)


class _Waiter:
    """An `on_done` that a caller can wait on; re-raises the copy's error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def __call__(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class BatchedKVConnector(KVBlobConnector):
    """`batched_from_gpu` / `batched_to_gpu` as one request-level copy. With ``on_done=None`` (and
    in `from_gpu` / `to_gpu`) the call returns only once the copy has completed."""

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self._issue(True, [memory_obj], [start], [end], kwargs, None)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self._issue(False, [memory_obj], [start], [end], kwargs, None)

    def batched_from_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                         ends: Sequence[int], *, on_done: CopyDone | None = None, **kwargs: Any) -> None:
        self._issue(True, memory_objs, starts, ends, kwargs, on_done)

    def batched_to_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                       ends: Sequence[int], *, on_done: CopyDone | None = None, **kwargs: Any) -> None:
        self._issue(False, memory_objs, starts, ends, kwargs, on_done)

    def _issue(self, gather: bool, objs: Sequence[MemoryObj], starts: Sequence[int],
               ends: Sequence[int], kwargs: dict[str, Any], on_done: CopyDone | None) -> None:
        if not len(objs) == len(starts) == len(ends):
            raise ValueError(f"{len(objs)} memory objects for {len(starts)} starts and {len(ends)} ends")
        if not objs:
            if on_done is not None:
                on_done(None)
            return
        blobs = [self.blob_of(obj, start, end, set_fmt=gather)
                 for obj, start, end in zip(objs, starts, ends, strict=True)]
        target = self._target(require_kvcaches(kwargs), blobs[0].dtype)
        if any(b.dtype != target.dtype for b in blobs):
            raise ValueError(f"memory objects of dtypes {sorted({str(b.dtype) for b in blobs})} do not "
                             f"all match the KV dtype {target.dtype}")
        slots = self._token_slots(kwargs, starts, ends, target)
        check_slots(slots, target.num_slots, gather)
        bounds = [0]
        for start, end in zip(starts, ends, strict=True):
            bounds.append(bounds[-1] + end - start)
        request = CopyRequest(gather, objs, blobs, slots, bounds)
        if on_done is not None:
            self._copy(target, request, on_done)
            return
        waiter = _Waiter()
        self._copy(target, request, waiter)
        waiter.wait()

    @abc.abstractmethod
    def _target(self, kvcaches: Any, dtype: torch.dtype) -> CopyTarget:
        """The engine's caches resolved for copying (a `CopyTarget`); ValueError if they are not
        of this connector's layout or not of `dtype`."""

    @abc.abstractmethod
    def _token_slots(self, kwargs: dict[str, Any], starts: Sequence[int], ends: Sequence[int],
                     target: Any) -> torch.Tensor:
        """``[N]`` int64 CPU slots of the tokens of every range, range after range."""

    @abc.abstractmethod
    def _copy(self, target: Any, request: CopyRequest, on_done: CopyDone) -> None:
        """Issue the copy; call `on_done` exactly once when it completed, unless this raises (then
        nothing may be left in flight)."""


def slots_from_mapping(kwargs: dict[str, Any], starts: Sequence[int], ends: Sequence[int]) -> torch.Tensor:
    """The ``slot_mapping`` kwarg (slot of every token of the whole sequence: ``[T]``, or ``[G, T]``
    with one row per KV cache group) cut to the ranges, as ``[N]`` / ``[G, N]`` int64 on the CPU (a
    CUDA slot mapping costs one device-to-host copy)."""
    slot_mapping = require_slot_mapping(kwargs)
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() not in (1, 2) \
            or slot_mapping.shape[-1] < max(ends):
        shape = tuple(slot_mapping.shape) if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping)
        raise ValueError(f"slot_mapping of shape {shape} does not cover tokens [{min(starts)}, {max(ends)})")
    consecutive = all(ends[i] == starts[i + 1] for i in range(len(starts) - 1))
    if consecutive:
        slots = slot_mapping[..., starts[0]: ends[-1]]
    else:
        slots = torch.cat([slot_mapping[..., a:b] for a, b in zip(starts, ends, strict=True)], dim=-1)
    return slots.to("cpu", torch.int64).contiguous()


def check_slots(slots: torch.Tensor, num_slots: int, gather: bool) -> None:
    """ValueError for slots at or beyond `num_slots`, and for negative slots when storing from a
    one-group ``[N]`` mapping (per-group ``[G, N]`` rows may leave tokens a group does not hold)."""
    if slots.numel() == 0:
        return
    if int(slots.max()) >= num_slots:
        bad = slots[slots >= num_slots]
        raise ValueError(f"slot_mapping holds {bad.numel()} slot(s) outside [0, {num_slots}) (beyond the "
                         f"cache's end) in the requested range, e.g. {int(bad[0])}")
    if gather and slots.dim() == 1 and int(slots.min()) < 0:
        negative = int((slots < 0).sum())
        raise ValueError(f"slot_mapping has {negative} negative slot(s) in the range to store: those tokens "
                         "have no KV in this engine to store (a -1 marks KV the engine already holds)")
