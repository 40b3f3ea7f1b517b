"""The cache server's control messages: one JSON object per ZMQ message, checked field by field.

An engine's DEALER socket sends requests; the server's ROUTER answers each one that has an ``id``
(an int the engine picks, echoed back) and stays silent for those without (notifications:
commit, abort, release, unlease, bye). Every request but ``hello`` names the server's
``session`` and the ``engine`` id ``hello`` gave out.

Requests (beside ``op``, ``id``, ``session``, ``engine``) and their answers' fields:

- ``hello`` {pid, name, client, metadata} -> {session, engine, arena, arena_size, heartbeat, grown,
  texts}: attach (`metadata` is the engine's `LMCacheEngineMetadata`, see `metadata_to_wire`;
  `client`, optional, names the engine-side client: its earlier attachments that hold nothing are
  dropped; `texts`: the server publishes KV events, so commits should carry the chunks' texts);
- ``heartbeat`` {} -> {grown}: (`grown`: the bytes at the arena's start the server hands slots
  out of so far; an engine maps their pages ahead of its first copy);
- ``contains`` {keys} -> {hits}: which keys a tier of the server holds;
- ``lease`` {lease, keys, ttl} -> {hits}: pin the cached prefix of `keys` and start loading its
  lower-tier chunks into L1 (where the engine's last ``contains`` found them, when it asked about
  these keys: a leased lookup asks the tiers once); ``unlease`` {lease};
- ``reserve`` {shapes, dtype} -> {slots: [[slot, offset], ...]}: slots of the arena the engine
  writes chunks into, for the leading shapes that fit (fewer: L1 is full, or the shapes add up to
  more than it holds; a single shape larger than the arena is a bad request); ``commit`` {slots,
  keys, texts} makes them those keys' chunks (each slot named once; `texts`, optional: per key
  null or ``[the chunk hash of the chunk before or null, base64 of the token ids as little-endian
  int64]``, what the server's KV events say the chunk holds: `text_to_wire`), ``abort`` {slots}
  gives them back;
- ``get`` {keys} -> {objs: [[read, offset, shape, dtype], ...]}: the cached prefix, held for the
  engine (never evicted or reused) until ``release`` {reads};
- ``bye`` {}: the engine leaves; everything it held is given back.

A bad request gets {ok: false, error, code}; `code` "session" (the server restarted since the
engine attached: attach again) or "engine" (the server does not know this engine: it was reaped,
attach again) or "bad" (the request is malformed: nothing of it was done, the engine stays
attached); a request the server failed on gets code "internal".
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import sys
from array import array
from typing import Any

import numpy as np
import torch

from lmcache.cache_key import CacheEngineKey, dtype_tag
from lmcache.chunk_hash import ChunkText
from lmcache.config import LMCacheEngineMetadata

NOTIFICATIONS = frozenset({"commit", "abort", "release", "unlease", "bye"})
REQUESTS = frozenset({"hello", "heartbeat", "contains", "lease", "reserve", "get"})
OPS = NOTIFICATIONS | REQUESTS
MAX_KEYS = 1 << 16  # keys in one request (a 16M-token prompt at chunk size 256)
MAX_DIMS = 8
MAX_TEXT_TOKENS = 1 << 16  # token ids in one chunk's text
DTYPES = {dtype_tag(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                    torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)}


class BadMessage(ValueError):
    """A request that cannot be right; `code` says what the engine should do about it."""

    def __init__(self, message: str, code: str = "bad") -> None:
        super().__init__(message)
        self.code = code


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(frames: list[bytes]) -> dict[str, Any]:
    """The request carried by `frames` (the body frames of one ZMQ message); BadMessage unless it
    is one JSON object with a known ``op`` and, if present, an int ``id``."""
    if len(frames) != 1:
        raise BadMessage(f"a request is one frame, got {len(frames)}")
    try:
        message = json.loads(frames[0])
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, an int too long, nested too deep
        raise BadMessage(f"not JSON: {str(e)[:200]}") from None
    if not isinstance(message, dict):
        raise BadMessage(f"a request is a JSON object, got {type(message).__name__}")
    if not isinstance(message.get("op"), str) or message["op"] not in OPS:  # (a list is unhashable)
        raise BadMessage(f"unknown op {message.get('op')!r}; known: {sorted(OPS)}")
    if "id" in message and not _is_int(message["id"]):
        raise BadMessage(f"'id' must be an int, got {message['id']!r}")
    return message


def decode_reply(frames: list[bytes]) -> dict[str, Any]:
    """A server's answer ({} if it is not one JSON object: it then matches no request)."""
    try:
        reply = json.loads(frames[-1]) if frames else None
    except (ValueError, RecursionError):
        return {}
    return reply if isinstance(reply, dict) else {}


def error(request_id: Any, message: str, code: str = "bad") -> dict[str, Any]:
    return {"ok": False, "id": request_id if _is_int(request_id) else None, "error": message, "code": code}


# ---- fields -------------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def field(message: dict[str, Any], name: str) -> Any:
    if name not in message:
        raise BadMessage(f"{message['op']}: missing field {name!r}")
    return message[name]


def int_field(message: dict[str, Any], name: str, low: int = 0) -> int:
    value = field(message, name)
    if not _is_int(value) or value < low:
        raise BadMessage(f"{message['op']}: {name!r} must be an int >= {low}, got {value!r}")
    return int(value)


def str_field(message: dict[str, Any], name: str, max_len: int = 1024) -> str:
    value = field(message, name)
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise BadMessage(f"{message['op']}: {name!r} must be a string of 1..{max_len} characters")
    return value


def seconds_field(message: dict[str, Any], name: str) -> float:
    value = field(message, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise BadMessage(f"{message['op']}: {name!r} must be a number of seconds > 0, got {value!r}")
    return float(value)


def int_list(message: dict[str, Any], name: str) -> list[int]:
    value = field(message, name)
    if not isinstance(value, list) or len(value) > MAX_KEYS or not all(_is_int(v) and v >= 0 for v in value):
        raise BadMessage(f"{message['op']}: {name!r} must be a list of ints >= 0")
    return value


def text_to_wire(text: ChunkText | None) -> list[Any] | None:
    """A chunk's text in a commit: ``[parent chunk hash or null, token ids]``, the ids as base64 of
    little-endian int64s (a JSON list of numbers costs far more to write and check)."""
    if text is None:
        return None
    ids = np.asarray(text.token_ids, dtype="<i8")
    return [text.parent, base64.b64encode(ids.tobytes()).decode("ascii")]


def texts_field(message: dict[str, Any], n: int) -> list[ChunkText | None] | None:
    """The optional ``texts`` of a commit: None, or one entry per key, each None or what
    `text_to_wire` writes."""
    value = message.get("texts")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        raise BadMessage(f"{message['op']}: 'texts' must be a list of {n} entries, one per key")
    return [None if entry is None else _text_of(message, entry) for entry in value]


def _text_of(message: dict[str, Any], entry: Any) -> ChunkText:
    if isinstance(entry, list) and len(entry) == 2:
        parent, encoded = entry
        ids = _token_ids(encoded)
        if ids is not None and (parent is None or (isinstance(parent, str) and 0 < len(parent) <= 4096)):
            return ChunkText(parent, ids)
    raise BadMessage(f"{message['op']}: a text is [the parent's chunk hash or null, base64 of 1 to "
                     f"{MAX_TEXT_TOKENS} token ids >= 0 as little-endian int64]")


def _token_ids(encoded: Any) -> array | None:
    """`text_to_wire`'s token ids back (1 to MAX_TEXT_TOKENS, each >= 0), or None."""
    if not isinstance(encoded, str) or not 0 < len(encoded) <= MAX_TEXT_TOKENS * 8 * 4 // 3 + 4:
        return None
    try:
        raw = base64.b64decode(encoded, validate=True)
    except binascii.Error:
        return None
    if not raw or len(raw) % 8 or len(raw) > MAX_TEXT_TOKENS * 8:
        return None
    ids = array("q")
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids if min(ids) >= 0 else None


def keys_field(message: dict[str, Any]) -> list[CacheEngineKey]:
    value = field(message, "keys")
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise BadMessage(f"{message['op']}: 'keys' must be a list of at most {MAX_KEYS} keys")
    return [key_of(message, k) for k in value]


def key_of(message: dict[str, Any], value: Any) -> CacheEngineKey:
    if not isinstance(value, str) or len(value) > 4096:
        raise BadMessage(f"{message['op']}: a key is a string, got {type(value).__name__}")
    try:
        return CacheEngineKey.from_string(value)
    except ValueError as e:
        raise BadMessage(f"{message['op']}: {e}") from None


def shapes_field(message: dict[str, Any], dtype: torch.dtype, max_bytes: int) -> list[torch.Size]:
    """The ``shapes`` of objects of `dtype`, each of at most `max_bytes` bytes (counted in Python
    ints: torch's numel() wraps around int64, so a huge shape would pass as empty)."""
    value = field(message, "shapes")
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise BadMessage(f"{message['op']}: 'shapes' must be a list of at most {MAX_KEYS} shapes")
    for shape in value:
        if not isinstance(shape, list) or not 0 < len(shape) <= MAX_DIMS or \
                not all(_is_int(v) and v > 0 for v in shape):
            raise BadMessage(f"{message['op']}: a shape is a list of 1..{MAX_DIMS} ints > 0, "
                             f"got {str(shape)[:200]}")
        if math.prod(shape) * dtype.itemsize > max_bytes:
            raise BadMessage(f"{message['op']}: a shape {str(shape)[:200]} of {dtype_tag(dtype)} is more "
                             f"than the {max_bytes} bytes of the arena")
    return [torch.Size(shape) for shape in value]


def dtype_field(message: dict[str, Any]) -> torch.dtype:
    value = field(message, "dtype")
    if value not in DTYPES:
        raise BadMessage(f"{message['op']}: 'dtype' must be one of {sorted(DTYPES)}, got {value!r}")
    return DTYPES[value]


# ---- engine metadata ----------------------------------------------------------------------------

def metadata_to_wire(metadata: LMCacheEngineMetadata) -> dict[str, Any]:
    wire = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(LMCacheEngineMetadata)}
    return {**wire, "kv_dtype": dtype_tag(metadata.kv_dtype), "kv_shape": list(metadata.kv_shape)}


def metadata_field(message: dict[str, Any]) -> LMCacheEngineMetadata:
    value = field(message, "metadata")
    names = {f.name for f in dataclasses.fields(LMCacheEngineMetadata)}
    if not isinstance(value, dict) or set(value) != names:
        raise BadMessage(f"hello: 'metadata' must be an object with exactly the fields {sorted(names)}")
    if value["kv_dtype"] not in DTYPES or not isinstance(value["kv_shape"], list):
        raise BadMessage(f"hello: bad metadata kv_dtype/kv_shape {value['kv_dtype']!r}, "
                         f"{value['kv_shape']!r}")
    for name in ("model_name", "fmt", "layout", "model_fingerprint", "state_layout"):
        if not isinstance(value[name], str):
            raise BadMessage(f"hello: metadata {name!r} must be a string")
    try:
        return LMCacheEngineMetadata(**{**value, "kv_dtype": DTYPES[value["kv_dtype"]],
                                        "kv_shape": tuple(value["kv_shape"])})
    except (ValueError, TypeError, OverflowError) as e:  # OverflowError: an infinite kv_shape entry
        raise BadMessage(f"hello: bad metadata: {e}") from None
