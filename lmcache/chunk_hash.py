"""The chained hash that names a chunk of tokens (the `chunk_hash` of LMCache's cache keys).

Tokens are cut into `chunk_size` chunks (a trailing partial chunk is a chunk too). Chunk i's digest
chains over the previous one: ``h_i = xxh3_128(h_{i-1} || tokens_i as int64 LE)``, the chain seeded by
an optional `extra_key` (vLLM's cache_salt, a LoRA id) so different salts never share KV. 128 bits
make an accidental collision (wrong KV returned for other tokens) practically impossible. The hash
is deterministic across processes (no seed; Python's `hash()` is never used), so anyone holding a
prompt's token ids (a router) computes the same digests as the engine that stored it. No torch here.

`ChunkText` is what a stored chunk holds as text (its token ids and its parent's digest): engines
send it to a cache server with each commit, so the server's KV events name the tokens
(`lmcache.cache_server.kv_events`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import xxhash

ROOT = b"lmcache/chunk-hash/v1"


class ChunkText(NamedTuple):
    """A chunk's token ids and the hex digest of the chunk before it in its chain (None for the
    first chunk)."""

    parent: str | None
    token_ids: Sequence[int] | np.ndarray


def extra_key_of(cache_salt: str | None = None, lora_id: int | None = None,
                 media: Sequence[str] = ()) -> str | None:
    """The chain's seed for a request: what separates caches of the same tokens (`media`: the
    names of its multimodal inputs, whose placeholder tokens are the same whatever the input).
    ``%``, ``|`` and ``,`` inside the salt and the media names are percent-escaped, so no two
    requests share a seed (salt ``"a|lora=1"`` is not salt ``"a"`` with LoRA 1)."""
    parts = []
    if cache_salt:
        parts.append(f"salt={_escape(cache_salt)}")
    if lora_id is not None:
        parts.append(f"lora={lora_id}")
    if media:
        parts.append("mm=" + ",".join(_escape(m) for m in media))
    return "|".join(parts) or None


def _escape(field: str) -> str:
    return field.replace("%", "%25").replace("|", "%7C").replace(",", "%2C")


def chunk_digests(tokens: np.ndarray | Sequence[int], chunk_size: int, extra_key: str | None = None,
                  *, whole_only: bool = False) -> list[bytes]:
    """The 16-byte digest of every chunk of `tokens` (integers), in order; `whole_only`: of the
    whole chunks only (a trailing partial chunk left out). ValueError for tokens that are not
    integers (a float or bool token would otherwise be truncated into another prompt's ids)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}: must be > 0")
    ids = np.asarray(tokens)
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got {ids.dtype}")
    data = np.ascontiguousarray(ids, dtype="<i8").view(np.uint8)
    if data.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {np.shape(tokens)}")
    step = chunk_size * 8
    end = len(data) - len(data) % step if whole_only else len(data)
    # surrogatepass: a salt from JSON may hold a lone surrogate; valid text encodes as before
    prefix = xxhash.xxh3_128_digest(ROOT + (extra_key or "").encode("utf-8", "surrogatepass"))
    out = []
    for off in range(0, end, step):
        h = xxhash.xxh3_128()
        h.update(prefix)
        h.update(data[off:off + step].data)
        prefix = h.digest()
        out.append(prefix)
    return out
