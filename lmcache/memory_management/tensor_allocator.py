"""`TensorMemoryAllocator`: an explicit free list over one pre-allocated buffer.

First fit over free blocks sorted by address; sizes are rounded up to `ALIGN_BYTES`; a freed block
is merged with free neighbours, so free space is never fragmented into adjacent pieces. Returns
None when no free block is large enough (the caller evicts or stores less). Thread-safe.
"""

from __future__ import annotations

import abc
import bisect
import threading
from dataclasses import dataclass

import torch

from lmcache.memory_management.memory_obj import (
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)


@dataclass
class FreeBlock:
    start: int
    size: int


class MemoryAllocatorInterface(abc.ABC):
    lock: threading.Lock

    @abc.abstractmethod
    def allocate(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None,
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
    ) -> MemoryObj | None:
        """A new object with ref count 1, or None if there is no room."""

    @abc.abstractmethod
    def free(self, memory_obj: MemoryObj) -> None:
        """Return the memory. Not called directly: `ref_count_down` to zero calls it."""

    def get_ref_count(self, memory_obj: MemoryObj) -> int:
        return memory_obj.get_ref_count()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Give the memory back now. Objects still alive keep working; nothing is allocated after."""


class TensorMemoryAllocator(MemoryAllocatorInterface):
    ALIGN_BYTES = 512

    def __init__(self, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous():
            raise ValueError("TensorMemoryAllocator needs a contiguous buffer")
        self.buffer = tensor.view(torch.uint8).flatten()
        self.total = (self.buffer.numel() // self.ALIGN_BYTES) * self.ALIGN_BYTES
        self.lock = threading.Lock()
        self._free: list[FreeBlock] = [FreeBlock(0, self.total)] if self.total else []
        self._used: dict[int, int] = {}  # address -> physical size
        self._closed = False

    @classmethod
    def aligned_size(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN_BYTES) * cls.ALIGN_BYTES

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def allocate(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None,
        fmt: MemoryFormat = MemoryFormat.KV_BLOB,
    ) -> TensorMemoryObj | None:
        shape = torch.Size(shape)
        dtype = dtype or torch.uint8
        nbytes = shape.numel() * dtype.itemsize
        if nbytes <= 0:
            raise ValueError(f"cannot allocate an empty object of shape {tuple(shape)}")
        size = self.aligned_size(nbytes)
        with self.lock:
            if self._closed:
                return None
            for i, block in enumerate(self._free):
                if block.size >= size:
                    start = block.start
                    if block.size == size:
                        del self._free[i]
                    else:
                        block.start += size
                        block.size -= size
                    self._used[start] = size
                    break
            else:
                return None
        md = MemoryObjMetadata(shape, dtype, start, size, 1, fmt)
        return TensorMemoryObj(self.buffer[start : start + size], md, self)

    def free(self, memory_obj: MemoryObj) -> None:
        start, size = memory_obj.metadata.address, memory_obj.metadata.phy_size
        with self.lock:
            if self._used.get(start) != size:
                raise ValueError(f"double or foreign free at address {start} (size {size})")
            del self._used[start]
            i = bisect.bisect_left(self._free, start, key=lambda b: b.start)
            prev = self._free[i - 1] if i > 0 else None
            nxt = self._free[i] if i < len(self._free) else None
            if prev is not None and prev.start + prev.size == start:
                prev.size += size
                if nxt is not None and prev.start + prev.size == nxt.start:
                    prev.size += nxt.size
                    del self._free[i]
            elif nxt is not None and start + size == nxt.start:
                nxt.start, nxt.size = start, size + nxt.size
            else:
                self._free.insert(i, FreeBlock(start, size))

    def close(self) -> None:
        """Drop the arena: its memory goes back to the system now, or, if objects allocated from it
        are still alive, when the last of them goes (their views keep it). Deterministic: it does
        not wait for whoever still references the allocator to be collected."""
        with self.lock:
            self._closed = True
            self.buffer = self.buffer[:0].clone()

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used == total, nothing overlaps, free is coalesced."""
        with self.lock:
            spans = sorted([(b.start, b.size, "free") for b in self._free]
                           + [(a, s, "used") for a, s in self._used.items()])
            pos = 0
            last_kind = ""
            for start, size, kind in spans:
                if start != pos or size <= 0 or size % self.ALIGN_BYTES:
                    raise AssertionError(f"bad span {kind}@{start}+{size}, expected start {pos}")
                if kind == "free" and last_kind == "free":
                    raise AssertionError(f"adjacent free blocks at {start} were not coalesced")
                pos, last_kind = start + size, kind
            if pos != self.total:
                raise AssertionError(f"spans cover {pos} bytes, total is {self.total}")
