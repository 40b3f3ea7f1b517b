"""`TensorMemoryAllocator`: an explicit free list over one reserved buffer.

First fit over free blocks sorted by address; sizes are rounded up to `ALIGN_BYTES`; a freed block
is merged with free neighbours, so free space is never fragmented into adjacent pieces. Returns
None when no free block is large enough (the caller evicts or stores less). Thread-safe.

With `grow_bytes`, the buffer is reserved address space whose pages are touched a piece at a time:
the free list covers only the grown prefix; an allocation that does not fit grows it (by at least
`grow_bytes`, never past the buffer), and when less than a piece is left ahead of the highest
allocation, the next piece is touched in the background. Touching a page costs far more than
copying into it (page faults), so stores mostly find their pages ready, while an engine that
holds little keeps little resident. The background thread runs at the lowest CPU priority (Linux):
where the engine keeps every core busy (vLLM-CPU binds one thread per core), its page faults wait
for idle time instead of stalling the engine's threads at their barriers (an allocation that needs
the piece in growth waits for it while the engine's threads sleep, so it then gets the core).
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lmcache.memory_management.memory_obj import (
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
    release_all,
)

GROWER_NICENESS = 19  # the background growth's niceness: the lowest priority


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

    def fits(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None,
             fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> bool:
        """Whether such an object could be allocated once enough memory is free; False: it is
        larger than all of the memory (freeing or evicting cannot make it fit)."""
        return True

    @property
    def arena(self) -> torch.Tensor | None:
        """The one buffer every tensor object is carved from (uint8; for registering it with a
        transfer library), or None when objects are not carved from one buffer."""
        return None

    def allocate_many(self, shapes: Sequence[torch.Size], dtype: torch.dtype | None,
                      fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> list[MemoryObj]:
        """Objects for the leading `shapes` that fit, in order (stops at the first that does not)."""
        return allocate_leading(self.allocate, shapes, dtype, fmt)

    @property
    def available(self) -> bool:
        """False while the allocator cannot hand out memory for a reason other than being full
        (an engine's cache server is away): a store then skips quietly."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Give the memory back now. Objects still alive keep working; nothing is allocated after."""

    def check_integrity(self) -> None:  # noqa: B027 - optional hook
        """Raise AssertionError unless the books balance (free + used = total, nothing handed out
        twice). An allocator that keeps no books (each object its own tensor) has nothing to check."""


def allocate_leading(allocate: Callable[[torch.Size, torch.dtype | None, MemoryFormat], MemoryObj | None],
                     shapes: Sequence[torch.Size], dtype: torch.dtype | None,
                     fmt: MemoryFormat) -> list[MemoryObj]:
    """`allocate` each of `shapes` in order, up to the first that does not fit. If `allocate`
    raises, the objects taken so far are given back before the error propagates."""
    out: list[MemoryObj] = []
    try:
        for shape in shapes:
            obj = allocate(shape, dtype, fmt)
            if obj is None:
                break
            out.append(obj)
    except BaseException:
        release_all(out)
        raise
    return out


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize  # Python ints: torch's numel() wraps around int64


class TensorMemoryAllocator(MemoryAllocatorInterface):
    ALIGN_BYTES = 512

    def __init__(self, tensor: torch.Tensor, grow_bytes: int | None = None) -> None:
        """`tensor`: the buffer (its bytes are used as is). `grow_bytes`: None if the whole buffer
        is ready now; else the size of the pieces it is touched in (the first one now)."""
        if not tensor.is_contiguous():
            raise ValueError("TensorMemoryAllocator needs a contiguous buffer")
        if grow_bytes is not None and grow_bytes <= 0:
            raise ValueError(f"grow_bytes must be > 0, got {grow_bytes}")
        self.buffer = tensor.view(torch.uint8).flatten()
        self.total = (self.buffer.numel() // self.ALIGN_BYTES) * self.ALIGN_BYTES
        self.lock = threading.Lock()
        self._free: list[FreeBlock] = []
        self._used: dict[int, int] = {}  # address -> physical size
        self._closed = False
        self._step = self.total if grow_bytes is None else self.aligned_size(grow_bytes)
        self._grown = 0  # the free list and _used cover [0, _grown)
        self._high = 0  # the end of the highest allocation so far
        self._grow_lock = threading.Lock()  # one grower at a time
        self._grower: threading.Thread | None = None
        self._grow(self._step, touch=grow_bytes is not None)

    @property
    def arena(self) -> torch.Tensor | None:
        return self.buffer

    @property
    def grown(self) -> int:
        """Bytes of the buffer the allocator hands out from so far (<= total)."""
        return self._grown

    def _grow(self, nbytes: int, seen: int | None = None, touch: bool = True) -> bool:
        """Add the next `nbytes` (at least) of the buffer to the free list, touching its pages
        first (outside the allocator's lock: nobody else has them yet). True if the arena grew,
        here or since the caller saw it `seen` bytes large; False if it is fully grown."""
        with self._grow_lock:
            if seen is not None and self._grown != seen:
                return True
            start = self._grown
            end = min(self.total, start + self.aligned_size(max(nbytes, self._step)))
            if end <= start or self._closed:
                return False
            if touch:
                self.buffer[start:end].zero_()
            with self.lock:
                self._add_free(start, end - start)
                self._grown = end
            return True

    def _grow_ahead(self) -> None:
        if sys.platform == "linux":  # per thread there (elsewhere it would lower the whole process)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GROWER_NICENESS)
        try:
            self._grow(self._step)
        finally:
            with self.lock:
                self._grower = None

    def wait_grown(self, timeout: float | None = None) -> bool:
        """Wait for a background growth in flight (tests, benchmarks, close). True when none is."""
        grower = self._grower
        if grower is not None:
            grower.join(timeout)
            return not grower.is_alive()
        return True

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
        nbytes = _nbytes(shape, dtype)
        if nbytes <= 0:
            raise ValueError(f"cannot allocate an empty object of shape {tuple(shape)}")
        size = self.aligned_size(nbytes)
        if size > self.total:
            return None  # never fits (and growing the buffer for it would only touch its pages)
        while True:
            seen = self._grown
            if (taken := self._first_fit(size)) is not None:
                break
            if not self._grow(size, seen):
                return None
        start, raw = taken
        return TensorMemoryObj(raw, MemoryObjMetadata(shape, dtype, start, size, 1, fmt), self)

    def fits(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None,
             fmt: MemoryFormat = MemoryFormat.KV_BLOB) -> bool:
        return self.aligned_size(_nbytes(torch.Size(shape), dtype or torch.uint8)) <= self.total

    def _first_fit(self, size: int) -> tuple[int, torch.Tensor] | None:
        """Take `size` bytes from the lowest free block that has them (their address and view);
        start a background growth when less than a piece is left above the highest allocation."""
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
            self._high = max(self._high, start + size)
            if self._grown < self.total and self._grown - self._high < self._step and self._grower is None:
                self._grower = threading.Thread(target=self._grow_ahead, name="lmcache-arena-grow",
                                                daemon=True)
                self._grower.start()
            return start, self.buffer[start : start + size]

    def free(self, memory_obj: MemoryObj) -> None:
        start, size = memory_obj.metadata.address, memory_obj.metadata.phy_size
        with self.lock:
            if self._used.get(start) != size:
                raise ValueError(f"double or foreign free at address {start} (size {size})")
            del self._used[start]
            self._add_free(start, size)

    def _add_free(self, start: int, size: int) -> None:
        """Put [start, start + size) in the free list, merged with free neighbours (lock held)."""
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
        self.wait_grown()
        with self._grow_lock, self.lock:
            self.buffer = self.buffer[:0].clone()

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used == grown (<= total), nothing overlaps, free is
        coalesced."""
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
            if pos != self._grown or self._grown > self.total:
                raise AssertionError(f"spans cover {pos} bytes, grown is {self._grown} of {self.total}")
