"""Serializer / Deserializer interfaces (seed 003).

A serializer turns a KV tensor into self-describing bytes; a deserializer turns such bytes back
into a tensor. Bytes from disk or the network are untrusted: a deserializer never unpickles, and
raises `CorruptBlobError` (a ValueError) for truncated, corrupted or foreign input, which the
storage tiers treat as a cache miss.
"""

from __future__ import annotations

import abc
import logging

import torch

logger = logging.getLogger(__name__)


class CorruptBlobError(ValueError):
    """The bytes are not a valid blob of the expected kind."""


class Serializer(abc.ABC):
    @abc.abstractmethod
    def to_bytes(self, t: torch.Tensor) -> bytes:
        """Serialize `t` (any device, shape, dtype) with its shape and dtype."""


class Deserializer(abc.ABC):
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    @abc.abstractmethod
    def from_bytes(self, bs: bytes) -> torch.Tensor:
        """The tensor serialized in `bs`; raises CorruptBlobError for invalid bytes."""


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
