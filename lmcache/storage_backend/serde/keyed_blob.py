"""A blob that names its key: what a disk cache file holds and what a peer sends.

    b"LMCK" | u32 key length | key (UTF-8) | blob (serde header with checksum + payload)

With sealing on (`seal`), the blob is sealed for the key (the key is associated data).

A reader passes the key it asked for: a value holding another key (a renamed file, a confused or
lying peer) is rejected, so it can never be served as the wrong chunk.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from lmcache.memory_management import MemoryObj
from lmcache.storage_backend.serde import blob as blob_header
from lmcache.storage_backend.serde.blob_stream import ReadStream, read_exact
from lmcache.storage_backend.serde.seal import Sealer, read_blob_sealed
from lmcache.storage_backend.serde.serde import AllocateFn, CorruptBlobError, Deserializer
from lmcache.write_parts import Buffer

MAGIC = b"LMCK"
_PREFIX = struct.Struct("<4sI")
MAX_KEY_BYTES = 4096
MIN_SIZE = _PREFIX.size + blob_header.HEADER_SIZE


def keyed_head(key_bytes: bytes) -> list[Buffer]:
    """What comes before the blob in a keyed blob (`write_parts.prefixed` puts it before parts
    sealed piece by piece)."""
    return [_PREFIX.pack(MAGIC, len(key_bytes)), key_bytes]


def keyed_parts(key_bytes: bytes, blob_parts: Sequence[Buffer], sealer: Sealer | None = None) -> list[Buffer]:
    """The pieces of a keyed blob, in order (the blob parts are not copied; sealed where `sealer`
    is set, into a new buffer: a writer done with them at once seals with `seal.sealed_parts`)."""
    if sealer is not None:
        blob_parts = [memoryview(sealer.seal(key_bytes, blob_parts))]
    return [*keyed_head(key_bytes), *blob_parts]


def read_key(stream: ReadStream, length: int) -> tuple[bytes, int]:
    """The key at the head of a keyed blob of `length` bytes in `stream`, and the length of the
    blob after it (read next with `blob_stream.read_blob`). Raises CorruptBlobError."""
    if length < MIN_SIZE:
        raise CorruptBlobError(f"keyed blob of {length} bytes is shorter than its headers")
    magic, key_len = _PREFIX.unpack(read_exact(stream, _PREFIX.size))
    if magic != MAGIC or key_len > MAX_KEY_BYTES or MIN_SIZE + key_len > length:
        raise CorruptBlobError("not an LMCache keyed blob (bad magic or key length)")
    return bytes(read_exact(stream, key_len)), length - _PREFIX.size - key_len


def read_keyed_blob(stream: ReadStream, length: int, key_bytes: bytes, serde_id: int, deser: Deserializer,
                    allocate: AllocateFn, sealer: Sealer | None = None) -> MemoryObj | None:
    """The keyed blob of `length` bytes at the head of `stream`, checked to hold `key_bytes`, in
    a buffer from `allocate` (None if it has no room). Raises CorruptBlobError if it does not
    verify (ForgedBlobError if it does not open with `sealer`, ForeignSerdeError for an intact
    blob of another serde)."""
    found, blob_len = read_key(stream, length)
    if found != key_bytes:
        raise CorruptBlobError("the blob holds a different key")
    return read_blob_sealed(stream, blob_len, key_bytes, sealer, serde_id, deser, allocate)
