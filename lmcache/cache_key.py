"""Cache keys: what names one stored chunk of KV."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

_SEP = "@"


@dataclass(frozen=True)
class CacheEngineKey:
    """One chunk's identity. `fmt` names the stored memory layout ("kv_blob" is the canonical one
    shared by every engine), `model_name` the model (plus a weights fingerprint when known),
    `chunk_hash` the chained prefix hash of the chunk's tokens, `dtype` the KV dtype.

    The string form ``fmt@model@world_size@worker_id@hash@dtype`` is stable across processes and
    versions; `@` and `%` inside fields are percent-escaped so `from_string` inverts it exactly."""

    fmt: str
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: str
    dtype: str

    def to_string(self) -> str:
        parts = (self.fmt, self.model_name, str(self.world_size), str(self.worker_id),
                 self.chunk_hash, self.dtype)
        return _SEP.join(quote(p, safe="/:.-_+#=") for p in parts)

    @staticmethod
    def from_string(s: str) -> CacheEngineKey:
        parts = s.split(_SEP)
        if len(parts) != 6:
            raise ValueError(f"malformed cache key {s!r}: expected 6 '@'-separated fields")
        fmt, model, ws, wid, chunk_hash, dtype = (unquote(p) for p in parts)
        if not (ws.isdigit() and wid.removeprefix("-").isdigit()):
            raise ValueError(f"malformed cache key {s!r}: world size and worker id must be integers")
        return CacheEngineKey(fmt, model, int(ws), int(wid), chunk_hash, dtype)

    def __str__(self) -> str:
        return self.to_string()


def dtype_tag(dtype: object) -> str:
    """'torch.bfloat16' -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")
