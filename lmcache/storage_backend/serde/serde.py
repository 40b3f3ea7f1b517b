"""Serializer / Deserializer interfaces (seed 003).

A serializer turns a KV tensor into self-describing bytes; a deserializer turns such bytes back
into a tensor. Bytes from disk or the network are untrusted: a deserializer never unpickles, and
raises `CorruptBlobError` (a ValueError) for truncated, corrupted or foreign input, which the
storage tiers treat as a cache miss.

Two non-abstract hooks let the tiers avoid copies: `Serializer.to_parts` returns the blob as
pieces that can be written one after another (a raw serializer hands out its payload without
copying it), and `Deserializer.from_bytes_to` deserializes straight into a buffer obtained from an
`allocate(shape, dtype, fmt)` callable. `Deserializer.raw_payload` is True when a blob's payload is
the tensor's bytes as they lie in memory, so a reader may place it directly into the buffer.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable

import torch

from lmcache.memory_management import MemoryFormat, MemoryObj

logger = logging.getLogger(__name__)

AllocateFn = Callable[[torch.Size, torch.dtype, MemoryFormat], MemoryObj | None]
"""`allocate(shape, dtype, fmt)`: a buffer with one reference for the caller, or None (no room)."""


class CorruptBlobError(ValueError):
    """The bytes are not a valid blob of the expected kind."""


class ForeignSerdeError(CorruptBlobError):
    """A valid-looking blob written by another serde (e.g. an engine with another remote_serde
    sharing the store): a miss, but nothing to delete."""


class Serializer(abc.ABC):
    @abc.abstractmethod
    def to_bytes(self, t: torch.Tensor) -> bytes:
        """Serialize `t` (any device, shape, dtype) with its shape and dtype."""

    def to_parts(self, t: torch.Tensor) -> list[bytes | memoryview]:
        """The same bytes as `to_bytes`, as pieces to write in order (may alias `t`'s memory, so
        keep `t` alive and unchanged until they are written)."""
        return [self.to_bytes(t)]


class Deserializer(abc.ABC):
    raw_payload: bool = False
    lossy: bool = False  # whether what it decodes only approximates what was serialized (CacheGen)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    @abc.abstractmethod
    def from_bytes(self, bs: bytes) -> torch.Tensor:
        """The tensor serialized in `bs`; raises CorruptBlobError for invalid bytes."""

    def from_bytes_to(self, bs: bytes | bytearray | memoryview, allocate: AllocateFn) -> MemoryObj | None:
        """Deserialize `bs` into a new KV_BLOB object from `allocate` (one reference, owned by the
        caller); None if `allocate` has no room. Raises CorruptBlobError for invalid bytes."""
        t = self.from_bytes(bs)  # type: ignore[arg-type]
        obj = allocate(t.shape, t.dtype, MemoryFormat.KV_BLOB)
        if obj is None:
            return None
        target = obj.tensor
        assert target is not None
        target.copy_(t)
        return obj


class SerializerDebugWrapper(Serializer):
    def __init__(self, s: Serializer) -> None:
        self.s = s

    def to_bytes(self, t: torch.Tensor) -> bytes:
        out = self.s.to_bytes(t)
        logger.debug("%s: %s %s -> %d bytes", type(self.s).__name__, tuple(t.shape), t.dtype, len(out))
        return out


class DeserializerDebugWrapper(Deserializer):
    def __init__(self, d: Deserializer) -> None:
        super().__init__(d.dtype)
        self.d = d

    def from_bytes(self, bs: bytes) -> torch.Tensor:
        t = self.d.from_bytes(bs)
        logger.debug("%s: %d bytes -> %s %s", type(self.d).__name__, len(bs), tuple(t.shape), t.dtype)
        return t
