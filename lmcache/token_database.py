"""Tokens (+ mask) -> chunk keys.

Tokens are cut into `chunk_size` chunks (the trailing partial chunk is a chunk too), each named by
its chained digest (`lmcache.chunk_hash`: deterministic across processes, seeded by an optional
`extra_key` such as vLLM's cache_salt or a LoRA id, so different salts never share KV).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import NamedTuple

import torch

from lmcache.cache_key import CacheEngineKey, dtype_tag
from lmcache.chunk_hash import chunk_digests
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata


class ChunkSpan(NamedTuple):
    """One chunk of a request: tokens ``[start, end)`` and its key (a tuple, so the seed's
    ``for start, end, key in process_tokens(...)`` still reads it)."""

    start: int
    end: int
    key: CacheEngineKey

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class TokenDatabase(abc.ABC):
    @abc.abstractmethod
    def process_tokens(
        self, tokens: torch.Tensor, mask: torch.Tensor | None = None, *, extra_key: str | None = None
    ) -> Iterable[ChunkSpan]:
        """Yield a `ChunkSpan` ``(start, end, key)`` for each chunk whose tokens the mask marks True.

        tokens: 1-D CPU integer tensor. mask: None or a bool tensor of the same length shaped
        ``F...FT...T``. Raises ValueError if the number of Falses is not a multiple of the chunk
        size (or the mask is not of that shape/length)."""


def num_masked_prefix(mask: torch.Tensor | None, num_tokens: int, chunk_size: int) -> int:
    """Number of leading Falses in `mask`, validated as the seed requires."""
    if mask is None:
        return 0
    if mask.dim() != 1 or mask.numel() != num_tokens:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; must be 1-D with {num_tokens} entries")
    m = mask.to(device="cpu", dtype=torch.bool)
    n_false = int(num_tokens - int(m.sum()))
    if bool(m[:n_false].any()) or not bool(m[n_false:].all()):
        raise ValueError("mask must look like F...FT...T (all Falses before all Trues)")
    if n_false % chunk_size != 0:
        raise ValueError(f"mask has {n_false} leading Falses; must be a multiple of chunk_size={chunk_size}")
    return n_false


class ChunkedTokenDatabase(TokenDatabase):
    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata) -> None:
        self.chunk_size = config.chunk_size
        model = metadata.model_name
        if metadata.model_fingerprint:
            model = f"{model}#{metadata.model_fingerprint}"
        self._key_fields = (metadata.layout, model, metadata.world_size, metadata.worker_id)
        self._dtype = dtype_tag(metadata.kv_dtype)

    def make_key(self, chunk_hash: str) -> CacheEngineKey:
        fmt, model, ws, wid = self._key_fields
        return CacheEngineKey(fmt, model, ws, wid, chunk_hash, self._dtype)

    def chunk_hashes(self, tokens: torch.Tensor, *, extra_key: str | None = None) -> list[str]:
        """Hex digests of every chunk of `tokens`, in order."""
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
        data = tokens.detach().to("cpu", torch.int64).numpy()
        return [d.hex() for d in chunk_digests(data, self.chunk_size, extra_key)]

    def process_tokens(
        self, tokens: torch.Tensor, mask: torch.Tensor | None = None, *, extra_key: str | None = None
    ) -> list[ChunkSpan]:
        hashes = self.chunk_hashes(tokens, extra_key=extra_key)
        n = tokens.shape[0]
        skip = num_masked_prefix(mask, n, self.chunk_size)
        cs = self.chunk_size
        return [
            ChunkSpan(i * cs, min((i + 1) * cs, n), self.make_key(digest))
            for i, digest in enumerate(hashes)
            if i * cs >= skip
        ]
