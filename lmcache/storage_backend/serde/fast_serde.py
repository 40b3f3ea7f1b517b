"""`fast`: the `naive` layout (raw tensor bytes behind the blob header, tagged "fast"), but
`from_bytes` returns a zero-copy tensor over the given bytes instead of an owned copy. Use it
when the caller keeps the bytes alive and only reads the tensor; the tiers place payloads into
their own buffers either way (`from_bytes_to`, `raw_payload`)."""

from __future__ import annotations

import torch

from lmcache.storage_backend.serde.naive_serde import RawDeserializer, RawSerializer


class FastSerializer(RawSerializer):
    serde_name = "fast"


class FastDeserializer(RawDeserializer):
    serde_name = "fast"

    def from_bytes_normal(self, b: bytes) -> torch.Tensor:
        """The tensor as an owned copy (the seed's non-zero-copy variant)."""
        return super().from_bytes(b)

    def from_bytes(self, b: bytes) -> torch.Tensor:
        view = self._view(self._unpack(b))
        return view if view.dtype == self.dtype else view.to(self.dtype)
