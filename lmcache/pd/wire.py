"""The KV channel's frames: what a sender (prefill instance) and a receiver (decode instance) say.

One TCP connection per (sender rank, receiver rank), request/response, blocking sockets. Every
message is a frame ``u32 length | JSON object`` (little-endian, at most `MAX_MESSAGE_BYTES`); raw KV
bytes follow a frame only where it says so, and go straight from the socket into the receiving
slot (`recv_into`), never through an intermediate buffer. The exchange:

    sender                                     receiver
    {"op": "hello", "channel", "nixl"?}   ->   {"ok", "channel", "nixl"?, "buffer"?}
    {"op": "offer", "chunks": [Chunk..]}  ->   {"ok", "slots": [Slot | "have" | "foreign" | null ..]}
    {"op": "written", "notif"?}
        + the bytes of every reserved slot
          not written through NIXL          ->   {"ok", "committed": n}

`hello` agrees on the channel: "nixl" when both sides have NIXL (the frames then carry each
agent's metadata, base64, and the receiver's buffer address) else "tcp". `offer` reserves room
for chunks in order: a slot (``{"offset", "inline"}``) is room reserved in the receive buffer,
"have" means the receiver holds the chunk already, "foreign" that it is not the receiver's model's
KV (another model, dtype, layout or rank: never retried), null that it has no room (nor for any
chunk after it); a chunk larger than the whole receive buffer makes the offer a bad frame.
`written` ends the offer (it must come within the receiver's `NOTIF_TIMEOUT`, or the connection
is closed and its reservations freed): the receiver reads the inline bytes, waits for the NIXL
notification `notif` of the others, and only then makes the reserved chunks visible; a
connection that breaks first frees its reservations, so a half-written chunk is never served.
A bad frame gets ``{"ok": false, "error": message}`` and the connection is closed.

With sealing on (`kv_encryption_key`), `hello` says ``"sealed": true`` (both sides must agree) and
every inline chunk goes as a sealed blob for its key (`serde.seal`: header, ciphertext, tag;
`seal.OVERHEAD` bytes more than the chunk), decrypted straight into its slot; a chunk that does
not open ends the connection, so its reservation is freed and never served. NIXL writes are not
sealed (they go between registered memories, not over this connection).
"""

from __future__ import annotations

import json
import math
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.memory_management import MemoryFormat

MAX_MESSAGE_BYTES = 16 << 20
MAX_CHUNKS_PER_OFFER = 4096
_LEN = struct.Struct("<I")
HAVE = "have"
FOREIGN = "foreign"


class WireError(ValueError):
    """A frame that breaks the protocol; the connection cannot be trusted any more."""


@dataclass(frozen=True)
class Chunk:
    """One stored object offered to a receiver: its key and the memory it needs
    (``shape`` x ``dtype`` = ``nbytes``, in memory format ``fmt``)."""

    key: CacheEngineKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # Python ints: torch's numel() wraps

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key.to_string(), "shape": list(self.shape),
                "dtype": str(self.dtype).removeprefix("torch."), "fmt": self.fmt.name}

    @staticmethod
    def from_json(d: Any, max_bytes: int) -> Chunk:
        """The chunk `d` describes; WireError for anything malformed, or a chunk of more than
        `max_bytes` bytes (the receive buffer's size: it could never be received)."""
        try:
            key = CacheEngineKey.from_string(d["key"])
            shape = tuple(int(x) for x in d["shape"])
            dtype = getattr(torch, d["dtype"])
            fmt = MemoryFormat[d["fmt"]]
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:  # Overflow: Infinity
            raise WireError(f"malformed chunk {str(d)[:200]}: {e!r}") from None
        if not isinstance(dtype, torch.dtype) or not shape or min(shape) <= 0:
            raise WireError(f"malformed chunk {str(d)[:200]}: bad dtype or shape")
        chunk = Chunk(key, shape, dtype, fmt)
        if chunk.nbytes > max_bytes:
            raise WireError(f"chunk {key.to_string()[:200]} of shape {list(shape)[:8]} needs "
                            f"{chunk.nbytes} bytes; the receive buffer holds {max_bytes}")
        return chunk


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_message(sock: socket.socket, body_timeout: float | None = None) -> dict[str, Any] | None:
    """The next frame as a dict; None if the peer closed the connection between frames.
    `body_timeout`: seconds the rest of a frame may take once its length has arrived (WireError
    after; a peer that stalls mid-frame would otherwise hold the frame's buffer for good)."""
    head = recv_exact(sock, _LEN.size, eof_ok=True)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE_BYTES:
        raise WireError(f"frame of {n} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    if body_timeout is None:
        body = recv_exact(sock, n)
    else:
        waited = sock.gettimeout()
        sock.settimeout(body_timeout)
        try:
            body = recv_exact(sock, n)
        except TimeoutError:
            raise WireError(f"a frame of {n} bytes did not arrive within {body_timeout:g} s") from None
        finally:
            sock.settimeout(waited)
    assert body is not None
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, an int too long, nested too deep
        raise WireError(f"frame is not JSON: {str(e)[:200]}") from None
    if not isinstance(message, dict):
        raise WireError(f"frame must be a JSON object, got {type(message).__name__}")
    return message


def recv_exact(sock: socket.socket, n: int, eof_ok: bool = False) -> bytearray | None:
    buf = bytearray(n)
    if not recv_into(sock, memoryview(buf), eof_ok):
        return None
    return buf


def recv_into(sock: socket.socket, view: memoryview, eof_ok: bool = False) -> bool:
    """Fill `view` from the socket; False if the peer closed before the first byte (`eof_ok`),
    ConnectionError if it closed in the middle."""
    first = True
    while view:
        got = sock.recv_into(view)
        if got == 0:
            if first and eof_ok:
                return False
            raise ConnectionError("connection closed in the middle of a frame")
        first = False
        view = view[got:]
    return True


class SocketReader:
    """A socket as a `blob_stream.ReadStream` (for opening a sealed chunk as it arrives)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def readinto(self, buffer: memoryview, /) -> int:
        return self._sock.recv_into(buffer)


def reply(sock: socket.socket, **fields: Any) -> None:
    send_message(sock, {"ok": True, **fields})


def expect_ok(message: dict[str, Any] | None) -> dict[str, Any]:
    """The answer to a request, or ConnectionError (closed) / WireError (refused, malformed)."""
    if message is None:
        raise ConnectionError("the receiver closed the connection")
    if message.get("ok") is not True:
        raise WireError(f"the receiver refused: {message.get('error', message)}")
    return message


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, for the socket."""
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
