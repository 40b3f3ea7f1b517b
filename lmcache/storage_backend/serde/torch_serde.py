"""`torch`: the payload is `torch.save` of the tensor (zip container), loaded back with
`torch.load(weights_only=True)`, which restores tensors only and never runs pickled code. Larger
and slower than `naive`; kept for compatibility with tools that read torch files."""

from __future__ import annotations

import io

import torch

from lmcache.storage_backend.serde import blob
from lmcache.storage_backend.serde.serde import CorruptBlobError, Deserializer, Serializer

SERDE = "torch"


class TorchSerializer(Serializer):
    def to_bytes(self, t: torch.Tensor) -> bytes:
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()  # torch.save writes the whole storage: never the whole arena around a view
        buf = io.BytesIO()
        torch.save(t, buf)
        payload = buf.getvalue()
        return blob.pack_header(SERDE, t.shape, t.dtype, payload) + payload


class TorchDeserializer(Deserializer):
    def from_bytes_normal(self, b: bytes) -> torch.Tensor:
        b_ = blob.unpack(b, SERDE)
        try:
            t = torch.load(io.BytesIO(b_.payload), weights_only=True, map_location="cpu")
        except Exception as e:  # whatever foreign bytes make torch.load raise
            raise CorruptBlobError(f"torch payload does not load: {e}") from e
        if not isinstance(t, torch.Tensor) or t.shape != b_.shape or t.dtype != b_.dtype:
            raise CorruptBlobError(f"torch payload holds {type(t).__name__} "
                                   f"{getattr(t, 'shape', '')}, header says {b_.dtype} {tuple(b_.shape)}")
        return t

    def from_bytes(self, b: bytes) -> torch.Tensor:
        t = self.from_bytes_normal(b)
        return t if t.dtype == self.dtype else t.to(self.dtype)
