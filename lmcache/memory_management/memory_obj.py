"""Memory objects: a buffer slice (or bytes) plus what it holds, with reference counting.

Ref-count contract: an allocator hands out an object with ref count 1, owned by the caller. Every
holder that keeps it (a cache tier, an in-flight write) calls `ref_count_up`; every holder that is
done calls `ref_count_down`; at zero the memory returns to its allocator and the object is invalid:
it exposes no memory any more (`tensor` is None, `byte_array` raises RuntimeError), because the
allocator may already have handed the same bytes to another object.
"""

from __future__ import annotations

import abc
import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class MemoryFormat(enum.Enum):
    UNDEFINED = 0
    KV_BLOB = 1
    """[2, num_layers, num_tokens, hidden_dim]: K and V of every layer, token-major."""
    BINARY = 2
    """A compressed / serialized byte array held in a tensor buffer."""
    BINARY_BUFFER = 3
    """A serialized byte array held in a Python bytes-like buffer."""


@dataclass
class MemoryObjMetadata:
    shape: torch.Size
    dtype: torch.dtype | None
    address: int
    phy_size: int
    ref_count: int
    fmt: MemoryFormat = MemoryFormat.UNDEFINED


_ORPHAN_LOCK = threading.Lock()


class Owner(Protocol):
    """Where an object's memory returns (an allocator): its `lock` guards the object's ref count,
    `free` takes the memory back when the count reaches zero."""

    lock: threading.Lock

    def free(self, memory_obj: MemoryObj) -> None: ...


class MemoryObj(abc.ABC):
    """Interface of everything a cache tier holds."""

    def __init__(self, metadata: MemoryObjMetadata, allocator: Owner | None) -> None:
        self._metadata = metadata
        self._allocator = allocator
        self._lock = allocator.lock if allocator is not None else _ORPHAN_LOCK
        self.valid = True

    @property
    def metadata(self) -> MemoryObjMetadata:
        return self._metadata

    def get_memory_format(self) -> MemoryFormat:
        return self._metadata.fmt

    def get_shape(self) -> torch.Size:
        return self._metadata.shape

    def get_dtype(self) -> torch.dtype | None:
        return self._metadata.dtype

    @abc.abstractmethod
    def get_size(self) -> int:
        """Bytes of the logical content (not the aligned physical size)."""

    @property
    @abc.abstractmethod
    def tensor(self) -> torch.Tensor | None:
        """The content as a tensor of `shape`/`dtype` (a view, no copy), or None (also once
        freed)."""

    @property
    @abc.abstractmethod
    def byte_array(self) -> memoryview:
        """The content as bytes (a view, no copy). RuntimeError once freed."""

    def _check_live(self) -> None:
        if not self.valid:
            raise RuntimeError("this MemoryObj was freed (its ref count reached zero); its memory "
                               "may belong to another object now")

    @abc.abstractmethod
    def _drop_memory(self) -> None:
        """Called once the ref count reaches zero: drop the view of the memory."""

    def ref_count_up(self) -> None:
        with self._lock:
            if not self.valid:
                raise RuntimeError("ref_count_up on a freed MemoryObj")
            self._metadata.ref_count += 1

    def ref_count_down(self) -> None:
        with self._lock:
            if self._metadata.ref_count <= 0:
                raise RuntimeError("ref_count_down below zero")
            self._metadata.ref_count -= 1
            release = self._metadata.ref_count == 0
            if release:
                self.valid = False
        if release:
            if self._allocator is not None:
                self._allocator.free(self)
            self._drop_memory()

    def get_ref_count(self) -> int:
        return self._metadata.ref_count


def release_all(objs: Sequence[MemoryObj | None]) -> None:
    """`ref_count_down` every object (None entries are skipped)."""
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


class TensorMemoryObj(MemoryObj):
    """A slice of an allocator's flat uint8 buffer; `raw_data` is that slice (phy_size bytes)."""

    def __init__(
        self,
        raw_data: torch.Tensor,
        metadata: MemoryObjMetadata,
        allocator: Owner | None = None,
    ) -> None:
        super().__init__(metadata, allocator)
        self.raw_data = raw_data

    def get_size(self) -> int:
        md = self._metadata
        assert md.dtype is not None
        return md.shape.numel() * md.dtype.itemsize

    @property
    def tensor(self) -> torch.Tensor | None:
        if not self.valid:
            return None
        md = self._metadata
        assert md.dtype is not None
        return self.raw_data[: self.get_size()].view(md.dtype).view(md.shape)

    @property
    def byte_array(self) -> memoryview:
        self._check_live()
        return self.raw_data[: self.get_size()].cpu().numpy().data

    def _drop_memory(self) -> None:
        # an empty tensor of its own: a zero-length view would keep the whole arena alive
        self.raw_data = torch.empty(0, dtype=self.raw_data.dtype)


class BytesBufferMemoryObj(MemoryObj):
    """Serialized bytes (format BINARY_BUFFER by default)."""

    def __init__(
        self,
        raw_bytes: bytes | bytearray | memoryview,
        metadata: MemoryObjMetadata | None = None,
        allocator: Owner | None = None,
    ) -> None:
        if metadata is None:
            metadata = MemoryObjMetadata(torch.Size([len(raw_bytes)]), None, 0, len(raw_bytes), 1,
                                         MemoryFormat.BINARY_BUFFER)
        super().__init__(metadata, allocator)
        self.raw_bytes = raw_bytes

    def get_size(self) -> int:
        return len(self.raw_bytes)

    @property
    def tensor(self) -> torch.Tensor | None:
        return None

    @property
    def byte_array(self) -> memoryview:
        self._check_live()
        return memoryview(self.raw_bytes)

    def _drop_memory(self) -> None:
        self.raw_bytes = b""
