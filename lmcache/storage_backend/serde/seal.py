"""Sealed blobs: AES-256-GCM around a serialized blob, bound to its chunk key.

With `kv_encryption_key` (a key file) or ``LMCACHE_KV_KEY`` every blob the disk, remote and peer
tiers write (and every chunk the PD channel sends inline over TCP) is sealed:

    offset size field
    0      4    magic b"LMCS"
    4      1    version (1)
    5      3    zero
    8      8    key id (`key_id`: which configured key sealed it)
    16     12   nonce (random per blob)
    28     8    length of the sealed bytes that follow (the serde blob, CacheGen streams included)
    36     n    ciphertext
    36+n   16   GCM tag

The associated data is the 36 header bytes followed by the chunk key (`CacheEngineKey.to_string()`
as UTF-8), so a blob copied under another key, cut short, replayed under another model (whose key
differs) or forged without the key does not open: `ForgedBlobError`, which the tiers treat as a
corrupt blob (a miss, deleted, counted as ``forged``). A blob sealed with a key that is no longer
configured (retired) is forged too. The first configured key seals; the others only open, so keys
rotate: put the new key first, keep the old one until its blobs have aged out.

AES-GCM comes from `cryptography` (OpenSSL underneath; its calls release the GIL, so the tiers'
worker threads seal and open side by side), through its streaming GCM cipher rather than the
one-shot `AESGCM`, which needs the whole blob in one buffer and returns a new one. One pass each
way, no copy added:
- Writing, for a writer done with each piece at once (the disk file, a SET, a socket), the blob
  is encrypted as it is written, SEAL_PIECE (2 MiB) at a time, into this thread's piece buffer
  (`Sealer.pieces`, `sealed_parts`: no whole sealed copy of a 6 MB chunk to write back out of
  memory, no fresh buffer to fault in per chunk); a blob that outlives the call (the peer
  server's reply) is encrypted straight into a new buffer (`seal`).
- Reading, `Sealer.open` returns a stream of the plaintext: the ciphertext is read straight into
  the caller's buffer and decrypted there in place, 256 KiB at a time (still in L2); its
  `finish()` checks the tag, and nothing read from it may be served before `finish()` returned.

Random 96-bit nonces: a key seals at most 2**32 blobs before it should be rotated (NIST SP
800-38D).

Key text (a key file, or the value of ``LMCACHE_KV_KEY``): keys of 64 hex digits (32 bytes), one
per line or separated by commas, newest first; blank lines and ``#`` comments are ignored.
`write_key_file` (``lmcache keygen PATH``) writes a new one with mode 0600.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    AEADEncryptionContext,
    Cipher,
    algorithms,
    modes,
)

from lmcache.memory_management import MemoryObj
from lmcache.storage_backend.serde.blob import SEALED_MAGIC
from lmcache.storage_backend.serde.blob_stream import (
    ReadStream,
    read_blob,
    read_exact,
    read_whole_blob,
    readinto_exact,
)
from lmcache.storage_backend.serde.serde import AllocateFn, CorruptBlobError, Deserializer
from lmcache.write_parts import Buffer, Parts, Pieces, nbytes_of

MAGIC = SEALED_MAGIC
VERSION = 1
KEY_BYTES = 32
TAG_BYTES = 16
_HEADER = struct.Struct("<4sB3x8s12sQ")
HEADER_SIZE = _HEADER.size
OVERHEAD = HEADER_SIZE + TAG_BYTES
KEY_ENV = "LMCACHE_KV_KEY"
_HEX_RUN = re.compile(f"[0-9a-fA-F]{{{KEY_BYTES},}}")
OPEN_PIECE = 256 << 10  # ciphertext read into place, then decrypted there while still in L2
# plaintext encrypted into a thread's buffer piece by piece as it is written: in A/B runs of the disk
# tier (Zen 4), 2 MiB pieces stored 1.07-1.14x as fast as sealing a whole 6 MB blob first, and
# 512 KiB pieces 0.93x (each piece costs a Python step and a write call)
SEAL_PIECE = 2 << 20
T = TypeVar("T")


class ForgedBlobError(CorruptBlobError):
    """A sealed blob that does not open with the configured keys and its chunk key (or an
    unsealed blob where sealing is on): forged, moved, truncated or sealed with a retired key."""


def key_id(key: bytes) -> bytes:
    """The 8-byte id a blob's header names its sealing key by (not secret: a hash of the key)."""
    return hashlib.sha256(b"lmcache kv key id\0" + key).digest()[:8]


class Sealer:
    """Seals with the first of `keys`, opens with any of them. Its repr names key ids only."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("a Sealer needs at least one key")
        if any(len(k) != KEY_BYTES for k in keys):
            raise ValueError(f"AES-256 keys are {KEY_BYTES} bytes")
        self._keys = {key_id(k): k for k in reversed(keys)}
        self.sealing_id = key_id(keys[0])

    @property
    def key_ids(self) -> list[str]:
        return [kid.hex() for kid in self._keys]

    def __repr__(self) -> str:
        return f"Sealer(sealing={self.sealing_id.hex()}, keys={len(self._keys)})"

    def sealed_size(self, parts: Sequence[Buffer]) -> int:
        return OVERHEAD + nbytes_of(parts)

    def _header(self, nonce: bytes, size: int) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.sealing_id, nonce, size - OVERHEAD)

    def _encryptor(self, nonce: bytes, header: bytes, chunk_key: bytes) -> AEADEncryptionContext:
        enc = Cipher(algorithms.AES(self._keys[self.sealing_id]), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(header + chunk_key)
        return enc

    def seal_into(self, chunk_key: bytes, parts: Sequence[Buffer], out: memoryview) -> memoryview:
        """Seal the blob `parts` (in order) for `chunk_key` into the head of `out` (at least
        `sealed_size(parts)` bytes): one pass, encrypted straight into place. Returns that head."""
        size = self.sealed_size(parts)
        if len(out) < size:
            raise ValueError(f"a sealed blob of {size} bytes does not fit in {len(out)}")
        nonce = os.urandom(12)
        header = self._header(nonce, size)
        out[:HEADER_SIZE] = header
        enc = self._encryptor(nonce, header, chunk_key)
        at = HEADER_SIZE
        for part in parts:
            view = memoryview(part).cast("B")
            at += enc.update_into(view, out[at:at + len(view)])  # releases the GIL
        enc.finalize()
        out[at:size] = enc.tag
        return out[:size]

    def seal(self, chunk_key: bytes, parts: Sequence[Buffer]) -> bytearray:
        """The sealed blob of `parts` for `chunk_key`, in a new buffer the caller owns."""
        out = bytearray(self.sealed_size(parts))
        self.seal_into(chunk_key, parts, memoryview(out))
        return out

    def pieces(self, chunk_key: bytes, parts: Sequence[Buffer]) -> Pieces:
        """The sealed blob of `parts` for `chunk_key`, for a writer done with each piece before it
        takes the next (a file, a socket): its header, its ciphertext SEAL_PIECE bytes at a time,
        each encrypted when taken into this thread's piece buffer, and its tag. A piece is
        released when the next is taken (kept longer, it raises rather than shows other bytes);
        taking them again seals the same bytes again (one nonce per blob), so a writer may retry."""
        size = self.sealed_size(parts)
        nonce = os.urandom(12)
        header = self._header(nonce, size)

        def make() -> Iterator[memoryview]:
            with _thread_buffer(SEAL_PIECE + TAG_BYTES) as buf:  # update_into's room: + a block
                enc = self._encryptor(nonce, header, chunk_key)
                yield memoryview(header)
                for part in parts:
                    view = memoryview(part).cast("B")
                    for at in range(0, len(view), SEAL_PIECE):
                        piece = buf[:enc.update_into(view[at:at + SEAL_PIECE], buf)]  # no GIL
                        yield piece
                        piece.release()
                enc.finalize()
                yield memoryview(enc.tag)

        return Pieces(size, make)

    def open(self, stream: ReadStream, length: int, chunk_key: bytes) -> OpenedBlob:
        """The plaintext of the sealed blob of `length` bytes at the head of `stream` (its header
        read now). Raises ForgedBlobError for a blob that is not sealed for `chunk_key` with one
        of the keys."""
        if length < OVERHEAD:
            raise ForgedBlobError(f"sealed blob of {length} bytes is shorter than its "
                                  f"{OVERHEAD}-byte frame")
        header = bytes(read_exact(stream, HEADER_SIZE))
        magic, version, kid, nonce, sealed_len = _HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            raise ForgedBlobError("not a sealed blob (sealing is on: unsealed blobs are not served)")
        if sealed_len != length - OVERHEAD:
            raise ForgedBlobError(f"sealed blob holds {length - OVERHEAD} bytes, its header says "
                                  f"{sealed_len}")
        key = self._keys.get(kid)
        if key is None:
            raise ForgedBlobError(f"sealed with key {kid.hex()}, which is not configured (retired?)")
        dec = Cipher(algorithms.AES(key), modes.GCM(nonce)).decryptor()
        dec.authenticate_additional_data(header + chunk_key)
        return OpenedBlob(stream, sealed_len, dec)


class OpenedBlob:
    """A `ReadStream` of a sealed blob's plaintext (`length` bytes). Unauthenticated until
    `finish()` returns: read all of it (through `read`), then call `finish()`."""

    def __init__(self, stream: ReadStream, length: int, decryptor: AEADDecryptionContext) -> None:
        self._stream = stream
        self.length = length
        self._left = length
        self._dec = decryptor

    def readinto(self, buffer: memoryview, /) -> int:
        n = min(len(buffer), self._left, OPEN_PIECE)
        if n == 0:
            return 0
        piece = buffer[:n]
        readinto_exact(self._stream, piece)  # the ciphertext straight into place,
        self._dec.update_into(piece, piece)  # decrypted there (in == out: OpenSSL allows it)
        self._left -= n
        return n

    def read(self, fn: Callable[[ReadStream, int], T]) -> T:
        """`fn(self, self.length)`; if it finds the plaintext invalid (any ValueError or
        OverflowError: it is unauthenticated, so even a parser's own slip on it may be tampering),
        the rest is read and the tag checked, so that tampering is reported as ForgedBlobError (an
        authentic blob's own error, e.g. ForeignSerdeError, is raised as it is)."""
        try:
            return fn(self, self.length)
        except (ValueError, OverflowError):  # CorruptBlobError is a ValueError
            self._drain()
            self.finish()
            raise

    def _drain(self) -> None:
        sink = memoryview(bytearray(min(self._left, 1 << 20)))
        while self._left:
            self.readinto(sink[: self._left])

    def finish(self) -> None:
        """Raise ForgedBlobError unless the whole blob was read and its tag verifies."""
        if self._left:
            raise ForgedBlobError(f"{self._left} sealed bytes were not read")
        tag = bytes(read_exact(self._stream, TAG_BYTES))
        try:
            self._dec.finalize_with_tag(tag)
        except InvalidTag:
            raise ForgedBlobError("sealed blob does not authenticate (forged, moved, or another "
                                  "key)") from None


_buffers = threading.local()


@contextmanager
def _thread_buffer(n: int) -> Iterator[memoryview]:
    """This thread's seal buffer (at least `n` bytes; grown, never shrunk) for the block; a
    nested use in the same thread (two sealed blobs taken in turn) gets a fresh buffer instead."""
    slot: _Slot | None = getattr(_buffers, "slot", None)
    if slot is None:
        slot = _buffers.slot = _Slot()
    if slot.busy:
        yield memoryview(bytearray(n))
        return
    if len(slot.buf) < n:
        slot.buf = bytearray(n)
    slot.busy = True
    try:
        yield memoryview(slot.buf)
    finally:
        slot.busy = False


class _Slot:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.busy = False


def sealed_parts(sealer: Sealer | None, chunk_key: bytes, parts: Sequence[Buffer]) -> Parts:
    """The blob `parts` as a writer done with each piece at once writes it for `chunk_key`:
    sealed piece by piece (`Sealer.pieces`) where `sealer` is set, else `parts` themselves."""
    return parts if sealer is None else sealer.pieces(chunk_key, parts)


def read_blob_sealed(stream: ReadStream, length: int, chunk_key: bytes, sealer: Sealer | None, serde_id: int,
                     deser: Deserializer, allocate: AllocateFn) -> MemoryObj | None:
    """`blob_stream.read_blob` of the blob of `length` bytes at the head of `stream`, opened first
    where `sealer` is set (the object is returned only once the tag verified; a raw payload is
    then not hashed again: the tag covers the blob header, checksum included, and every byte)."""
    if sealer is None:
        return read_blob(stream, length, serde_id, deser, allocate)
    opened = sealer.open(stream, length, chunk_key)
    obj = opened.read(lambda s, n: read_blob(s, n, serde_id, deser, allocate, checksum=False))
    if obj is None:
        return None  # no room: a miss, nothing served
    try:
        opened.finish()
    except BaseException:
        obj.ref_count_down()
        raise
    return obj


def read_whole_sealed(stream: ReadStream, length: int, chunk_key: bytes, sealer: Sealer | None) -> bytearray:
    """`blob_stream.read_whole_blob`, opened first where `sealer` is set."""
    if sealer is None:
        return read_whole_blob(stream, length)
    opened = sealer.open(stream, length, chunk_key)
    whole = opened.read(read_whole_blob)
    opened.finish()
    return whole


def parse_keys(text: str, source: str) -> list[bytes]:
    """The keys in key text (see the module doc); ValueError naming `source` and the line, never
    the key material."""
    keys: list[bytes] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for entry in line.split("#", 1)[0].split(","):
            entry = entry.strip()
            if not entry:
                continue
            try:
                key = bytes.fromhex(entry)
            except ValueError:
                key = b""
            if len(key) != KEY_BYTES:
                raise ValueError(f"{source}: line {lineno} holds an entry that is not a key of "
                                 f"{2 * KEY_BYTES} hex digits")
            keys.append(key)
    if not keys:
        raise ValueError(f"{source}: no key")
    return keys


def load_keys(key_file: str | None) -> list[bytes] | None:
    """The configured keys: from `key_file` (`kv_encryption_key`) if set, else from
    ``LMCACHE_KV_KEY``; None where neither is set (no sealing)."""
    if key_file is not None:
        if _looks_like_keys(key_file):
            raise ValueError("kv_encryption_key is the path of a key file, not key material (keys "
                             f"themselves go in {KEY_ENV}; a key file named with hex digits in the "
                             "current directory is ./NAME)")
        try:
            with open(key_file, encoding="ascii") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"kv_encryption_key {key_file!r}: cannot read the key file: "
                             f"{type(e).__name__}") from None
        return parse_keys(text, f"kv_encryption_key {key_file!r}")
    env = os.environ.get(KEY_ENV)
    if not env:
        return None
    return parse_keys(env, KEY_ENV)


def _looks_like_keys(value: str) -> bool:
    """Whether `value`, given as a key file's path, may hold key material (never to be echoed): a
    run of KEY_BYTES hex digits or more (half a key) and no directory in it: key text in any
    form, one key per line, a key mistyped, prefixed "0x" or followed by a comment."""
    return os.sep not in value and _HEX_RUN.search(value) is not None


def create_sealer(key_file: str | None) -> Sealer | None:
    keys = load_keys(key_file)
    return None if keys is None else Sealer(keys)


def write_key_file(path: str) -> str:
    """Write a new key file at `path` (mode 0600; refuses to overwrite) and return its key id.
    To rotate, put its key line first in the engine's key file and keep the old ones after it."""
    key = os.urandom(KEY_BYTES)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(f"# lmcache kv key, id {key_id(key).hex()}, created {stamp}\n{key.hex()}\n")
    return key_id(key).hex()
