"""`safe`: the payload is a safetensors file holding one tensor named "kv" (a JSON header plus raw
bytes; no code is ever executed on load). Readable by any safetensors tool."""

from __future__ import annotations

import torch
from safetensors.torch import load, save

from lmcache.storage_backend.serde import blob
from lmcache.storage_backend.serde.serde import CorruptBlobError, Deserializer, Serializer

SERDE = "safe"
_NAME = "kv"


class SafeSerializer(Serializer):
    def to_bytes(self, t: torch.Tensor) -> bytes:
        payload = save({_NAME: t.detach().to("cpu").contiguous()})
        return blob.pack_header(SERDE, t.shape, t.dtype, payload) + payload


class SafeDeserializer(Deserializer):
    def from_bytes_normal(self, b: bytearray | bytes) -> torch.Tensor:
        b_ = blob.unpack(b, SERDE)
        try:
            tensors = load(bytes(b_.payload))
        except Exception as e:  # whatever foreign bytes make safetensors raise
            raise CorruptBlobError(f"safetensors payload does not load: {e}") from e
        t = tensors.get(_NAME)
        if t is None or len(tensors) != 1 or t.shape != b_.shape or t.dtype != b_.dtype:
            raise CorruptBlobError(f"safetensors payload holds {sorted(tensors)}, expected one "
                                   f"{b_.dtype} tensor {_NAME!r} of shape {tuple(b_.shape)}")
        return t

    def from_bytes(self, b: bytearray | bytes) -> torch.Tensor:
        t = self.from_bytes_normal(b)
        return t if t.dtype == self.dtype else t.to(self.dtype)
