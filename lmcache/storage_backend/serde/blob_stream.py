"""Reading one serialized blob from a stream straight into an arena buffer.

A disk file and an lm:// socket both deliver a blob (header + payload) as a byte stream. For a
raw serde (the payload is the tensor's bytes, `Deserializer.raw_payload`) `read_blob` parses the
header, allocates the object, and reads the payload directly into it in pieces, hashing each piece
while it is still in cache: one pass over the bytes, no intermediate buffer. Other serdes (and
blobs written by another serde) are read whole and handed to `Deserializer.from_bytes_to`.
"""

from __future__ import annotations

from typing import Protocol

from lmcache.memory_management import MemoryFormat, MemoryObj
from lmcache.storage_backend.serde import blob as blob_header
from lmcache.storage_backend.serde.serde import AllocateFn, CorruptBlobError, Deserializer

READ_PIECE = 1 << 20  # hash pieces small enough to still be in L2 when hashed


class ReadStream(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None:
        """Fill (part of) `buffer`; the number of bytes read, 0 at the end of the stream."""


class BufferStream:
    """A `ReadStream` over bytes already in memory."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readinto(self, buffer: memoryview, /) -> int:
        n = min(len(buffer), len(self._view) - self._pos)
        buffer[:n] = self._view[self._pos: self._pos + n]
        self._pos += n
        return n


def read_exact(stream: ReadStream, n: int) -> bytearray:
    buf = bytearray(n)
    readinto_exact(stream, memoryview(buf))
    return buf


def readinto_exact(stream: ReadStream, view: memoryview,
                   verifier: blob_header.PayloadVerifier | None = None) -> None:
    """Fill `view` from `stream` in READ_PIECE pieces (hashed into `verifier` as they arrive)."""
    view = view.cast("B") if view.format != "B" else view
    while view:
        piece = view[:READ_PIECE]
        got = 0
        while got < len(piece):
            n = stream.readinto(piece[got:])
            if not n:
                raise CorruptBlobError("blob is truncated")
            got += n
        if verifier is not None:
            verifier.update(piece)
        view = view[len(piece):]


def read_blob(stream: ReadStream, blob_len: int, serde_id: int, deser: Deserializer,
              allocate: AllocateFn, checksum: bool = True) -> MemoryObj | None:
    """The blob of `blob_len` bytes at the head of `stream`, in a buffer from `allocate` (one
    reference, owned by the caller); None if `allocate` has no room (then the payload is left
    unread). `checksum=False`: a raw payload is not hashed (for a stream that authenticates it
    as a whole, a sealed blob's; its length is still checked). Raises CorruptBlobError
    (ForeignSerdeError for an intact blob of another serde)."""
    head, header = _read_header(stream, blob_len)
    if not (header.serde_id == serde_id and deser.raw_payload and header.dtype == deser.dtype):
        return deser.from_bytes_to(_with_payload(stream, head, header.payload_len), allocate)
    if blob_header.raw_size(header.shape, header.dtype) != header.payload_len:
        raise CorruptBlobError(f"payload of {header.payload_len} bytes does not hold "
                               f"{header.dtype} {tuple(header.shape)}")
    obj = allocate(header.shape, header.dtype, MemoryFormat.KV_BLOB)
    if obj is None:
        return None
    try:
        verifier = blob_header.PayloadVerifier(head, header) if checksum else None
        readinto_exact(stream, obj.byte_array, verifier)
        if verifier is not None:
            verifier.finish()
    except BaseException:
        obj.ref_count_down()
        raise
    return obj


def read_whole_blob(stream: ReadStream, blob_len: int) -> bytearray:
    """The blob of `blob_len` bytes at the head of `stream` in one buffer (for a deserializer that
    needs all of it), its length checked against its header. Raises CorruptBlobError."""
    head, header = _read_header(stream, blob_len)
    return _with_payload(stream, head, header.payload_len)


def _read_header(stream: ReadStream, blob_len: int) -> tuple[bytearray, blob_header.Header]:
    if blob_len < blob_header.HEADER_SIZE:
        raise CorruptBlobError(f"blob of {blob_len} bytes is shorter than its header")
    head = read_exact(stream, blob_header.HEADER_SIZE)
    header = blob_header.parse_header(head)
    if blob_len != blob_header.HEADER_SIZE + header.payload_len:
        raise CorruptBlobError(f"blob has {blob_len - blob_header.HEADER_SIZE} payload bytes, its "
                               f"header says {header.payload_len}")
    return head, header


def _with_payload(stream: ReadStream, head: bytearray, payload_len: int) -> bytearray:
    """`head` followed by the next `payload_len` bytes of `stream`, read in place."""
    whole = bytearray(len(head) + payload_len)
    whole[:len(head)] = head
    readinto_exact(stream, memoryview(whole)[len(head):])
    return whole
