"""The header every serialized blob carries, so that a truncated or foreign blob is detected.

Layout (little-endian), followed by `payload_len` payload bytes:

    offset size field
    0      4    magic b"LMCB"
    4      1    header version (1)
    5      1    serde id (which serializer wrote the payload, see SERDE_IDS)
    6      1    dtype code (see DTYPE_CODES)
    7      1    ndim (<= 8)
    8      8*8  shape, 8 unsigned 64-bit dims (unused ones 0; each below MAX_DIM)
    72     8    payload length
    80     8    xxh3-64 of bytes [0, 80) followed by the payload
    88          payload

`pack_header` writes the 88 bytes for a payload; `unpack` validates a whole blob and returns a
zero-copy view of its payload; `parse_header` + `verify_payload` (or a `PayloadVerifier` fed
piece by piece) do the same in steps, for a reader that places the payload straight into a buffer
it allocates after reading the header.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from lmcache.storage_backend.serde.serde import CorruptBlobError, ForeignSerdeError

MAGIC = b"LMCB"
SEALED_MAGIC = b"LMCS"  # a sealed blob (`serde.seal`) around one of these
VERSION = 1
MAX_NDIM = 8
MAX_DIM = 1 << 62  # far above any real dim, and below what torch.Size (int64) can hold
_FIXED = struct.Struct("<4sBBBB8QQ")
HEADER_SIZE = _FIXED.size + 8

SERDE_IDS = {"naive": 1, "torch": 2, "safe": 3, "fast": 4, "cachegen": 5}
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.uint8: 5,
    torch.int8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
    torch.float8_e4m3fn: 11, torch.float8_e5m2: 12,
}
_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Header:
    """The fields of a blob header (validated except for the checksum)."""

    serde_id: int
    dtype: torch.dtype
    shape: torch.Size
    payload_len: int
    checksum: int


@dataclass(frozen=True)
class Blob:
    serde_id: int
    dtype: torch.dtype
    shape: torch.Size
    payload: memoryview


def _checksum(head: bytes | memoryview, payload: bytes | memoryview | Sequence[bytes | memoryview]
              ) -> int:
    h = xxhash.xxh3_64(head)
    for part in [payload] if isinstance(payload, (bytes, memoryview)) else payload:
        h.update(part)
    return h.intdigest()


def raw_size(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a `dtype` tensor of `shape` (exact, for any dims read from a header: unlike
    `torch.Size.numel`, it neither overflows nor raises)."""
    return math.prod(shape) * dtype.itemsize


def pack_header(serde: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
                payload: bytes | memoryview | Sequence[bytes | memoryview]) -> bytes:
    """The header for `payload` (one buffer, or the pieces that follow the header in order)."""
    if len(shape) > MAX_NDIM:
        raise ValueError(f"cannot serialize a {len(shape)}-D tensor (at most {MAX_NDIM} dims)")
    if dtype not in DTYPE_CODES:
        raise ValueError(f"cannot serialize dtype {dtype}")
    dims = list(shape) + [0] * (MAX_NDIM - len(shape))
    parts = [payload] if isinstance(payload, (bytes, memoryview)) else payload
    size = sum(memoryview(p).nbytes for p in parts)  # bytes, also of a typed buffer
    head = _FIXED.pack(MAGIC, VERSION, SERDE_IDS[serde], DTYPE_CODES[dtype], len(shape), *dims, size)
    return head + struct.pack("<Q", _checksum(head, payload))


def parse_header(head: bytes | bytearray | memoryview, serde: str | None = None) -> Header:
    """Validate the first HEADER_SIZE bytes of a blob (all but the checksum, which needs the
    payload: see `verify_payload`). Lets a reader learn shape and dtype, allocate, and read the
    payload straight into place. Raises CorruptBlobError."""
    view = memoryview(head).cast("B")
    if len(view) < HEADER_SIZE:
        raise CorruptBlobError(f"blob of {len(view)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, serde_id, dtype_code, ndim, *rest = _FIXED.unpack_from(view)
    dims, payload_len = rest[:MAX_NDIM], rest[MAX_NDIM]
    if magic == SEALED_MAGIC:
        raise ForeignSerdeError("a sealed blob: reading it needs kv_encryption_key (or LMCACHE_KV_KEY)")
    if magic != MAGIC:
        raise CorruptBlobError("not an LMCache blob (bad magic)")
    if version != VERSION:
        raise CorruptBlobError(f"unsupported blob version {version}")
    if dtype_code not in _DTYPES or ndim > MAX_NDIM:
        raise CorruptBlobError(f"bad dtype code {dtype_code} or ndim {ndim}")
    if any(d >= MAX_DIM for d in dims[:ndim]):
        raise CorruptBlobError(f"bad shape {tuple(dims[:ndim])} (a dim is not below 2**62)")
    if serde is not None and serde_id != SERDE_IDS[serde]:
        raise ForeignSerdeError(f"blob was written by serde id {serde_id}, expected {serde!r}")
    (checksum,) = struct.unpack_from("<Q", view, _FIXED.size)
    return Header(serde_id, _DTYPES[dtype_code], torch.Size(dims[:ndim]), payload_len, checksum)


class PayloadVerifier:
    """Checks a payload that arrives in pieces (e.g. read from a file straight into its buffer, a
    piece at a time, so each piece is hashed while it is still in cache)."""

    def __init__(self, head: bytes | bytearray | memoryview, header: Header) -> None:
        self.header = header
        self._hash = xxhash.xxh3_64(memoryview(head)[: _FIXED.size])
        self._received = 0

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        self._hash.update(piece)
        self._received += len(piece)

    def finish(self) -> None:
        """Raise CorruptBlobError unless the pieces were exactly the payload the header describes."""
        if self._received != self.header.payload_len:
            raise CorruptBlobError(f"blob has {self._received} payload bytes, header says "
                                   f"{self.header.payload_len}")
        if self._hash.intdigest() != self.header.checksum:
            raise CorruptBlobError("blob checksum mismatch (corrupted)")


def verify_payload(head: bytes | bytearray | memoryview, header: Header,
                   payload: bytes | bytearray | memoryview) -> None:
    """Raise CorruptBlobError unless `payload` is exactly the payload `head` describes."""
    if len(payload) != header.payload_len:  # before hashing gigabytes of the wrong thing
        raise CorruptBlobError(f"blob has {len(payload)} payload bytes, header says {header.payload_len}")
    verifier = PayloadVerifier(head, header)
    verifier.update(payload)
    verifier.finish()


def unpack(blob: bytes | bytearray | memoryview, serde: str | None = None) -> Blob:
    """Validate `blob` and return its fields; raises CorruptBlobError for anything invalid, and
    its subclass ForeignSerdeError for an intact blob of another serde than `serde`."""
    view = memoryview(blob).cast("B")
    header = parse_header(view)
    payload = view[HEADER_SIZE:]
    verify_payload(view, header, payload)
    if serde is not None and header.serde_id != SERDE_IDS[serde]:
        raise ForeignSerdeError(f"blob was written by serde id {header.serde_id}, expected {serde!r}")
    return Blob(header.serde_id, header.dtype, header.shape, payload)
