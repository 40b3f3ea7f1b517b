"""Where a request's chunk objects live: pieces of contiguous memory and the chunk groups in them.

The engine allocates a request's chunk objects one after another from one arena, so they usually
lie back to back (each aligned to the allocator's 512 bytes). A `Piece` is a run of objects that
are adjacent in memory (the next starts where the previous one's aligned allocation ends), up to a
size limit: ONE copy moves all of it between the arena and a staging buffer laid out the same way.
Inside a piece, a `ChunkGroup` is a run of objects of equal token count with no padding between
them, so the group is one ``[count, 2 * num_layers, tokens, hidden]`` tensor and a kernel moves
each K/V source's rows for all its chunks in one operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache.memory_management import MemoryObj


@dataclass(frozen=True)
class ChunkGroup:
    """`count` chunks of `tokens` tokens each, back to back from `offset` bytes into their piece;
    their slots start at index `first_token` of the request's slot array."""

    count: int
    tokens: int
    offset: int
    first_token: int

    @property
    def num_tokens(self) -> int:
        return self.count * self.tokens


@dataclass
class Piece:
    """`memory`: uint8 ``[nbytes]`` view of the objects' bytes (with alignment padding between
    them), where they live. Its tokens are slots ``[first_token, first_token + num_tokens)``."""

    memory: torch.Tensor
    first_token: int
    groups: list[ChunkGroup]

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    @property
    def num_tokens(self) -> int:
        return sum(g.num_tokens for g in self.groups)


def plan_pieces(objs: Sequence[MemoryObj], blobs: Sequence[torch.Tensor], bounds: Sequence[int],
                max_bytes: int | None = None) -> list[Piece]:
    """Cut the request's objects (in request order) into pieces of adjacent objects of at most
    `max_bytes` (None: no limit; one object larger than the limit is a piece by itself)."""
    pieces = []
    first = 0
    for c in range(1, len(blobs) + 1):
        if c == len(blobs) or not _continues(objs, blobs, first, c, max_bytes):
            pieces.append(_piece(objs, blobs, bounds, first, c))
            first = c
    return pieces


def group_view(buffer: torch.Tensor, group: ChunkGroup, num_sources: int, hidden: int,
               dtype: torch.dtype) -> torch.Tensor:
    """``[count, num_sources, tokens, hidden]`` view of `group` in a uint8 `buffer` laid out like
    its piece (the arena itself or a staging buffer)."""
    nbytes = group.count * num_sources * group.tokens * hidden * dtype.itemsize
    return buffer[group.offset: group.offset + nbytes].view(dtype).view(
        group.count, num_sources, group.tokens, hidden)


def _physical(obj: MemoryObj, blob: torch.Tensor) -> int:
    """Bytes the allocator reserved for the object (its size rounded up to the alignment)."""
    return max(int(obj.metadata.phy_size), blob.nbytes)


def _continues(objs: Sequence[MemoryObj], blobs: Sequence[torch.Tensor], first: int, c: int,
               max_bytes: int | None) -> bool:
    """Whether object `c` extends the piece of objects ``[first, c)``."""
    prev, blob = blobs[c - 1], blobs[c]
    if blob.untyped_storage().data_ptr() != prev.untyped_storage().data_ptr():
        return False
    if blob.data_ptr() != prev.data_ptr() + _physical(objs[c - 1], prev):
        return False
    return max_bytes is None or blob.data_ptr() + blob.nbytes - blobs[first].data_ptr() <= max_bytes


def _piece(objs: Sequence[MemoryObj], blobs: Sequence[torch.Tensor], bounds: Sequence[int],
           first: int, end: int) -> Piece:
    """The piece of objects ``[first, end)`` (adjacent in memory)."""
    base = blobs[first].data_ptr()
    groups: list[ChunkGroup] = []
    for c in range(first, end):
        tokens = bounds[c + 1] - bounds[c]
        packed = c > first and _physical(objs[c - 1], blobs[c - 1]) == blobs[c - 1].nbytes
        if groups and groups[-1].tokens == tokens and packed:
            last = groups[-1]
            groups[-1] = ChunkGroup(last.count + 1, tokens, last.offset, last.first_token)
        else:
            groups.append(ChunkGroup(1, tokens, blobs[c].data_ptr() - base, bounds[c]))
    nbytes = blobs[end - 1].data_ptr() + blobs[end - 1].nbytes - base
    return Piece(_bytes_from(blobs[first], nbytes), bounds[first], groups)


def _bytes_from(blob: torch.Tensor, nbytes: int) -> torch.Tensor:
    """uint8 ``[nbytes]`` view of the memory starting at `blob` (within its storage)."""
    raw = blob.view(-1).view(torch.uint8)
    return raw.as_strided((nbytes,), (1,), raw.storage_offset())
