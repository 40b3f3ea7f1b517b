"""The allocator family over `TensorMemoryAllocator`, one per kind of memory.

Host arenas reserve their size and are touched in pieces of `GROW_BYTES` as they fill (an idle
engine keeps one piece resident, not its whole `max_local_cpu_size`); the next piece is touched in
the background before it is needed, so a store rarely pays page faults in its copy (a first touch
costs 0.7-3.4 GB/s here versus ~22 GB/s for memcpy). Pinned (CUDA) and GPU arenas are still
allocated and touched whole, up front: pinning a piece at a time is not done yet.
"""

from __future__ import annotations

import logging
import threading

import torch

from lmcache.memory_management.memory_obj import (
    BytesBufferMemoryObj,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
)
from lmcache.memory_management.tensor_allocator import MemoryAllocatorInterface, TensorMemoryAllocator
from lmcache.observability import log_once

logger = logging.getLogger(__name__)


GROW_BYTES = 256 << 20  # a host arena's piece


def _arena(size: int, device: str = "cpu", pin: bool = False, touch: bool = True) -> torch.Tensor:
    if size <= 0:
        raise ValueError(f"allocator size must be > 0 bytes, got {size}")
    buf = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)
    if touch:
        buf.zero_()  # fault every page in now, not during the first store
    return buf


class HostMemoryAllocator(TensorMemoryAllocator):
    """Pageable host memory, touched a piece at a time as it fills."""

    def __init__(self, size: int) -> None:
        super().__init__(_arena(size, touch=False), grow_bytes=GROW_BYTES)


class PinMemoryAllocator(TensorMemoryAllocator):
    """Page-locked host memory when CUDA is present (fast DMA to the GPU); without CUDA there is
    nothing to pin for, so it uses pageable memory and says so once (`is_pinned` tells which)."""

    def __init__(self, size: int) -> None:
        self.is_pinned = torch.cuda.is_available()
        if not self.is_pinned:
            log_once(logger, "no-cuda", "CUDA is not available: PinMemoryAllocator uses pageable host memory",
                     level=logging.INFO)
        if self.is_pinned:
            super().__init__(_arena(size, pin=True))
        else:
            super().__init__(_arena(size, touch=False), grow_bytes=GROW_BYTES)


class GPUMemoryAllocator(TensorMemoryAllocator):
    def __init__(self, size: int, device: str = "cuda") -> None:
        try:
            buf = _arena(size, device=device)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(f"GPUMemoryAllocator: device {device!r} is not usable: {e}") from e
        super().__init__(buf)


class BufferAllocator(MemoryAllocatorInterface):
    """Serialized blobs as Python byte buffers (format BINARY_BUFFER); `shape[0]` is the length."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.lock = threading.Lock()

    def allocate(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None,
        fmt: MemoryFormat = MemoryFormat.BINARY_BUFFER,
    ) -> BytesBufferMemoryObj:
        n = int(torch.Size(shape).numel())
        md = MemoryObjMetadata(torch.Size([n]), None, 0, n, 1, MemoryFormat.BINARY_BUFFER)
        return BytesBufferMemoryObj(bytearray(n), md, self)

    def free(self, memory_obj: MemoryObj) -> None:
        pass  # the bytes go with the last reference


class MixedMemoryAllocator(MemoryAllocatorInterface):
    """Tensors (KV_BLOB, BINARY, UNDEFINED) in a pinned/host arena of `size` bytes (or in
    `tensors`, an arena allocator of the caller's); BINARY_BUFFER in byte buffers."""

    def __init__(self, size: int, tensors: TensorMemoryAllocator | None = None) -> None:
        self.pin_allocator = tensors if tensors is not None else PinMemoryAllocator(size)
        self.buffer_allocator = BufferAllocator()
        self.lock = self.pin_allocator.lock

    def allocate(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None,
        fmt: MemoryFormat = MemoryFormat.KV_BLOB,
    ) -> MemoryObj | None:
        if fmt == MemoryFormat.BINARY_BUFFER:
            return self.buffer_allocator.allocate(shape, dtype, fmt)
        return self.pin_allocator.allocate(shape, dtype, fmt)

    def fits(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None,
             fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> bool:
        return fmt == MemoryFormat.BINARY_BUFFER or self.pin_allocator.fits(shape, dtype, fmt)

    def free(self, memory_obj: MemoryObj) -> None:
        if isinstance(memory_obj, BytesBufferMemoryObj):
            self.buffer_allocator.free(memory_obj)
        else:
            self.pin_allocator.free(memory_obj)

    @property
    def arena(self) -> torch.Tensor | None:
        return self.pin_allocator.arena

    def close(self) -> None:
        self.pin_allocator.close()

    def check_integrity(self) -> None:
        self.pin_allocator.check_integrity()

    @property
    def total(self) -> int:
        return self.pin_allocator.total

    @property
    def used_bytes(self) -> int:
        return self.pin_allocator.used_bytes
