"""`naive`: the payload is the tensor's bytes exactly as they lie in memory (contiguous, native
little-endian), behind the blob header. The reference format: no encoding work at all, and a
reader can place the payload straight into its buffer (`raw_payload`).

`RawSerializer` / `RawDeserializer` are shared with `fast_serde`, which differs only in returning
zero-copy views from `from_bytes`.
"""

from __future__ import annotations

import warnings

import torch

from lmcache.memory_management import MemoryFormat, MemoryObj
from lmcache.storage_backend.serde import blob
from lmcache.storage_backend.serde.serde import AllocateFn, CorruptBlobError, Deserializer, Serializer


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` (moved to CPU and made contiguous if needed; no copy otherwise)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


class RawSerializer(Serializer):
    serde_name = "naive"

    def to_parts(self, t: torch.Tensor) -> list[bytes | memoryview]:
        payload = tensor_bytes(t)
        return [blob.pack_header(self.serde_name, t.shape, t.dtype, payload), payload]

    def to_bytes(self, t: torch.Tensor) -> bytes:
        return b"".join(self.to_parts(t))


class RawDeserializer(Deserializer):
    serde_name = "naive"
    raw_payload = True

    def _unpack(self, bs: bytes | bytearray | memoryview) -> blob.Blob:
        b = blob.unpack(bs, self.serde_name)
        if blob.raw_size(b.shape, b.dtype) != len(b.payload):
            raise CorruptBlobError(f"payload of {len(b.payload)} bytes does not hold a {b.dtype} "
                                   f"tensor of shape {tuple(b.shape)}")
        return b

    @staticmethod
    def _view(b: blob.Blob) -> torch.Tensor:
        """A tensor of the blob's shape over its payload (no copy; must not be written to)."""
        if len(b.payload) == 0:
            return torch.empty(b.shape, dtype=b.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read
            return torch.frombuffer(b.payload, dtype=torch.uint8).view(b.dtype).view(b.shape)

    def from_bytes(self, bs: bytes) -> torch.Tensor:
        return self._view(self._unpack(bs)).to(self.dtype, copy=True)

    def from_bytes_to(self, bs: bytes | bytearray | memoryview, allocate: AllocateFn) -> MemoryObj | None:
        b = self._unpack(bs)
        obj = allocate(b.shape, self.dtype, MemoryFormat.KV_BLOB)
        if obj is None:
            return None
        if b.dtype == self.dtype:
            obj.byte_array[:] = b.payload  # one memcpy
        else:
            target = obj.tensor
            assert target is not None
            target.copy_(self._view(b))
        return obj


class NaiveSerializer(RawSerializer):
    pass


class NaiveDeserializer(RawDeserializer):
    pass
