"""The lm:// wire protocol: length-prefixed binary frames over TCP.

Every request is a 16-byte header followed by `key_len` key bytes and `value_len` value bytes;
every response a 16-byte header followed by `value_len` value bytes (all little-endian):

    request:  u16 magic 0x4C4D ("LM") | u8 version | u8 op     | u32 key_len | u64 value_len
    response: u16 magic 0x4C4D        | u8 version | u8 status | u32 0       | u64 value_len

Ops (key = a UTF-8 cache key of at most MAX_KEY_BYTES; only PUT carries a value):
    PUT     store value under key                      -> OK | TOO_LARGE (value > capacity)
    GET     fetch key                                  -> OK + value | NOT_FOUND
    EXISTS  is key stored                              -> OK | NOT_FOUND
    DELETE  drop key                                   -> OK | NOT_FOUND
    LIST    keys starting with `key` (a prefix)        -> OK + (u16 length | key bytes)*
    HEALTH  liveness and usage                         -> OK + JSON {"items", "bytes", "capacity",
                                                          "ops": requests served by op name}
    AUTH    present the shared secret as `key`         -> OK | UNAUTHORIZED (then closed)
A server started with a secret answers UNAUTHORIZED to anything before a successful AUTH and
closes the connection. A malformed or oversize header gets an ERROR response (value = message, at
most MAX_MESSAGE_BYTES, as for every status but OK) and the connection is closed; requests on
other connections are unaffected. Requests on one connection are answered in order, so a client
may pipeline them.
"""

from __future__ import annotations

import enum
import struct

MAGIC = 0x4C4D
VERSION = 1
HEADER = struct.Struct("<HBBIQ")
HEADER_SIZE = HEADER.size
MAX_KEY_BYTES = 1024
DEFAULT_MAX_VALUE_BYTES = 512 << 20
MAX_MESSAGE_BYTES = 64 << 10  # the most a response other than OK carries (an ERROR's message)
_LIST_ITEM = struct.Struct("<H")


class Op(enum.IntEnum):
    PUT = 1
    GET = 2
    EXISTS = 3
    DELETE = 4
    LIST = 5
    HEALTH = 6
    AUTH = 7


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    ERROR = 2
    UNAUTHORIZED = 3
    TOO_LARGE = 4


class ProtocolError(ValueError):
    """A frame that breaks the protocol; the connection it came on cannot be trusted any more."""


def pack_request(op: Op, key: bytes, value_len: int = 0) -> bytes:
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes exceeds the {MAX_KEY_BYTES}-byte limit")
    return HEADER.pack(MAGIC, VERSION, op, len(key), value_len) + key


def unpack_request(head: bytes, max_value_bytes: int) -> tuple[Op, int, int]:
    """(op, key_len, value_len) of a request header; raises ProtocolError."""
    magic, version, op, key_len, value_len = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad frame header (magic {magic:#x}, version {version})")
    try:
        op = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    if key_len > MAX_KEY_BYTES:
        raise ProtocolError(f"key of {key_len} bytes exceeds the {MAX_KEY_BYTES}-byte limit")
    if value_len > max_value_bytes:
        raise ProtocolError(f"value of {value_len} bytes exceeds the {max_value_bytes}-byte frame limit")
    if value_len and op != Op.PUT:
        raise ProtocolError(f"{op.name} carries no value, got {value_len} bytes")
    return op, key_len, value_len


def pack_response(status: Status, value_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, status, 0, value_len)


def unpack_response(head: bytes) -> tuple[Status, int]:
    magic, version, status, _, value_len = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad response header (magic {magic:#x}, version {version})")
    try:
        status = Status(status)
    except ValueError:
        raise ProtocolError(f"unknown status {status}") from None
    if status != Status.OK and value_len > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a {status.name} refusal claims a {value_len}-byte message (at most "
                            f"{MAX_MESSAGE_BYTES})")
    return status, value_len


def pack_key_list(keys: list[bytes]) -> bytes:
    return b"".join(_LIST_ITEM.pack(len(k)) + k for k in keys)


def unpack_key_list(data: bytes | bytearray) -> list[bytes]:
    keys, pos = [], 0
    while pos < len(data):
        if pos + _LIST_ITEM.size > len(data):
            raise ProtocolError("truncated key list")
        (n,) = _LIST_ITEM.unpack_from(data, pos)
        pos += _LIST_ITEM.size
        if pos + n > len(data):
            raise ProtocolError("truncated key list")
        keys.append(bytes(data[pos : pos + n]))
        pos += n
    return keys
