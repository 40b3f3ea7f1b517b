"""`StagedCopier`: a whole request between an engine's KV cache and the chunk objects, through a
reusable staging buffer on the cache's device laid out exactly like the objects in the arena.

A request's objects are cut into pieces of adjacent memory (`spans.plan_pieces`, at most
`piece_bytes` each, or one object if larger). Per piece, a row kernel (`triton_rows`: one launch;
or `torch_rows`: O(layers) torch ops) gathers all its tokens from the cache into a staging slot,
and ONE copy moves the slot to the arena (store); a retrieve runs the other way.

On CUDA the copy is asynchronous and ordered by events, never by host synchronisation:

- store: a compute stream waits for the caller's current stream, gathers piece i into a staging
  slot and records "gathered"; a DMA stream waits for it and copies the slot to pinned host memory
  (``non_blocking``), so the gather of piece i+1 overlaps the DMA of piece i. The caller's stream
  waits only for the last gather (then the engine's blocks may be reused); `on_done` runs on the
  completion thread once the last DMA has finished (the objects are complete).
- retrieve: the DMA stream copies piece i from host memory to a slot, the compute stream scatters
  it into the cache once it landed (after the caller's earlier work); the caller's stream waits on
  the last scatter's event; `on_done` runs once the last DMA finished (the host objects are free).

Staging memory is bounded by `staging_bytes`: a ring of ``staging_bytes // slot size`` slots (at
least 2); reusing a slot waits (on the device) for the event of its previous use. On other devices
(CPU when forced with ``LMCACHE_STAGED_COPY=1``) the same issuing code runs with `HostOrdering`:
every step completes in order before the next, `on_done` runs before `copy` returns, and CI checks
the result bit for bit against the native path.
"""

from __future__ import annotations

import importlib
import logging
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from lmcache.gpu_connector.batched import CopyRequest
from lmcache.gpu_connector.interface import CopyDone
from lmcache.gpu_connector.ordering import ordering_for
from lmcache.gpu_connector.sources import KVSources
from lmcache.gpu_connector.spans import Piece, plan_pieces
from lmcache.gpu_connector.torch_rows import copy_piece_torch

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 512 << 20
DEFAULT_PIECE_BYTES = 32 << 20
KERNELS = ("auto", "triton", "torch")


@dataclass
class _Slot:
    buffer: torch.Tensor
    free: Any = None  # torch.cuda.Event after which the buffer may be reused (None: unused)


class StagedCopier:
    def __init__(self, device: torch.device | str, *, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 piece_bytes: int = DEFAULT_PIECE_BYTES, kernel: str = "auto") -> None:
        if staging_bytes <= 0 or piece_bytes <= 0:
            raise ValueError(f"staging_bytes={staging_bytes} and piece_bytes={piece_bytes} must be > 0")
        if kernel not in KERNELS:
            raise ValueError(f"unknown staged copy kernel {kernel!r}; expected one of {KERNELS}")
        self.device = torch.device(device)
        self.staging_bytes, self.piece_bytes = staging_bytes, piece_bytes
        self._triton = _load_triton() if kernel == "triton" or (
            kernel == "auto" and self.device.type == "cuda") else None
        if kernel == "triton" and self._triton is None:
            raise ValueError("staged copy kernel 'triton' requested but Triton is not importable")
        self._triton_ran: set[tuple[bool, int, int]] = set()  # (gather, hidden, vec) launched fine
        self._lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._capacity = 0
        self._next = 0
        self._offsets: tuple[weakref.ref[KVSources], torch.Tensor] | None = None
        self._order = ordering_for(self.device)
        self._compute = self._order.new_stream()
        self._dma = self._order.new_stream()

    @property
    def kernel(self) -> str:
        return "triton" if self._triton is not None else "torch"

    @property
    def staging(self) -> tuple[int, int]:
        """The staging ring now: (slots allocated, bytes per slot); at most ``max(2,
        staging_bytes // slot size)`` slots."""
        with self._lock:
            return len(self._slots), self._capacity

    def copy(self, sources: KVSources, request: CopyRequest, on_done: CopyDone) -> None:
        """Issue the request's copy; `on_done` runs once it completed (before returning, off CUDA)."""
        largest = max(b.nbytes for b in request.blobs)
        pieces = plan_pieces(request.objs, request.blobs, request.bounds, max(self.piece_bytes, largest))
        use_triton = self._triton is not None and self._triton.supports(sources)
        tables = self._tables(request, pieces, sources, use_triton)
        vec = self._triton.vector_width(sources, tables) if use_triton and self._triton else 1
        with self._lock:
            done = self._issue(sources, request, pieces, tables, use_triton, vec)
        self._order.complete(done, on_done)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every issued copy has completed and its `on_done` ran; False on timeout."""
        return self._order.drain(timeout)

    def _issue(self, sources: KVSources, request: CopyRequest, pieces: list[Piece], tables: torch.Tensor,
               use_triton: bool, vec: int = 1) -> Any:
        """Issue every piece; returns the event that completes with the request's last DMA."""
        order, compute, dma = self._order, self._compute, self._dma
        caller = order.current()
        order.wait(compute, order.record(caller))
        with order.use(compute):
            device_tables = tables.to(self.device, non_blocking=True)
            offsets = self._source_offsets(sources) if use_triton else None
        capacity = max(p.nbytes for p in pieces)
        try:
            last = None
            for piece in pieces:
                slot = self._take(capacity)
                staged = slot.buffer[: piece.nbytes]
                if request.gather:
                    order.wait(compute, slot.free)
                    with order.use(compute):
                        self._kernel(True, sources, piece, slot.buffer, request, device_tables, offsets, vec)
                    last = order.record(compute)
                    order.wait(dma, last)
                    with order.use(dma):
                        piece.memory.copy_(staged, non_blocking=True)
                    slot.free = order.record(dma)
                else:
                    order.wait(dma, slot.free)
                    with order.use(dma):
                        staged.copy_(piece.memory, non_blocking=True)
                    order.wait(compute, order.record(dma))
                    with order.use(compute):
                        self._kernel(False, sources, piece, slot.buffer, request, device_tables, offsets, vec)
                    last = slot.free = order.record(compute)
            order.wait(caller, last)
            return order.record(dma)
        except BaseException:
            order.synchronize(compute)  # nothing may stay in flight when the issue fails
            order.synchronize(dma)
            raise

    def _kernel(self, gather: bool, sources: KVSources, piece: Piece, buffer: torch.Tensor,
                request: CopyRequest, device_tables: torch.Tensor, offsets: torch.Tensor | None,
                vec: int = 1) -> None:
        if offsets is not None and self._triton is not None:
            if (gather, sources.hidden, vec) in self._triton_ran:
                self._triton.copy_piece_triton(gather, sources, piece, buffer, device_tables, offsets, vec)
                return
            try:  # a kernel that cannot compile or launch here costs speed, never the copy
                self._triton.copy_piece_triton(gather, sources, piece, buffer, device_tables, offsets, vec)
                self._triton_ran.add((gather, sources.hidden, vec))
                return
            except Exception:
                logger.exception("the Triton row kernel failed to compile or launch; staged KV copies "
                                 "use torch ops from now on")
                self._triton = None
        copy_piece_torch(gather, sources, piece, buffer, request.slots, device_tables[0])

    # ---- tables, offsets and staging slots ------------------------------------------------------

    def _tables(self, request: CopyRequest, pieces: list[Piece], sources: KVSources,
                use_triton: bool) -> torch.Tensor:
        """``[1, N]`` slots, or ``[3, N]`` slots + buffer tables for Triton (pinned on CUDA)."""
        rows = 3 if use_triton else 1
        tables = torch.empty(rows, request.slots.numel(), dtype=torch.int64,
                             pin_memory=self._order.pin_tables)
        tables[0] = request.slots
        if use_triton:
            assert self._triton is not None
            tables[1:] = self._triton.buffer_tables(pieces, request.slots.numel(), sources)
        return tables

    def _source_offsets(self, sources: KVSources) -> torch.Tensor:
        """`sources.element_offsets()` on the device, uploaded once per sources object."""
        if self._offsets is None or self._offsets[0]() is not sources:
            offsets = sources.element_offsets()
            assert offsets is not None
            if self._order.pin_tables:
                offsets = offsets.pin_memory()
            self._offsets = (weakref.ref(sources), offsets.to(self.device, non_blocking=True))
        return self._offsets[1]

    def _take(self, capacity: int) -> _Slot:
        """The next staging slot of the ring (at least `capacity` bytes)."""
        if capacity > self._capacity:
            for slot in self._slots:  # growing: the old buffers must be idle before they go
                self._order.host_wait(slot.free)
            self._slots, self._capacity, self._next = [], capacity, 0
        count = max(2, self.staging_bytes // self._capacity)
        if self._next == len(self._slots):
            self._slots.append(_Slot(self._allocate(self._capacity)))
        slot = self._slots[self._next]
        self._next = (self._next + 1) % count
        return slot

    def _allocate(self, nbytes: int) -> torch.Tensor:
        with self._order.use(self._compute):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


def _load_triton() -> ModuleType | None:
    try:
        return importlib.import_module("lmcache.gpu_connector.triton_rows")
    except ImportError as e:
        logger.warning("Triton is not available (%s); staged KV copies use torch ops", e)
        return None
