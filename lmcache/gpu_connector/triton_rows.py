"""Moving a piece's tokens between `KVSources` and a staging buffer with ONE Triton kernel launch.

Program (i, s) moves the rows of ``TOKENS`` consecutive tokens of the piece for source s (K or V
of one layer). Per token, three int64 tables (uploaded once per request) give its slot, where its
source-0 row starts in the buffer and the distance between sources there (the buffer is laid out
like the chunk objects: ``[2L, n_c, hidden]`` per chunk). Source s is addressed as an element offset
from source 0 (all sources share their strides), so any number of per-layer tensors, in any of
the paged / token-major / HF layouts, is one launch. Values move as integers of the same width
(bit-exact for every dtype). Negative slots are skipped (scatter only; a gather never has them).

Imported only where the staged path runs with Triton (CUDA; or CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmcache.gpu_connector.sources import KVSources
from lmcache.gpu_connector.spans import Piece

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ELEMENTS_PER_PROGRAM = 8192


@triton.jit
def _copy_rows_kernel(src, src_offsets, slots, buf, row_offsets, source_strides, num_tokens,
                      block_size, block_stride, token_stride, head_stride, head_size, hidden,
                      SCATTER: tl.constexpr, TOKENS: tl.constexpr, COLS: tl.constexpr):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    s = tl.program_id(1)
    in_range = t < num_tokens
    slot = tl.load(slots + t, mask=in_range, other=-1)
    buf_row = tl.load(row_offsets + t, mask=in_range, other=0) \
        + s * tl.load(source_strides + t, mask=in_range, other=0)
    block = slot // block_size
    src_row = tl.load(src_offsets + s) + block * block_stride + (slot - block * block_size) * token_stride
    cols = tl.arange(0, COLS)
    inner = (cols // head_size).to(tl.int64) * head_stride + cols % head_size
    mask = (in_range & (slot >= 0))[:, None] & (cols < hidden)[None, :]
    src_ptrs = src + src_row[:, None] + inner[None, :]
    buf_ptrs = buf + buf_row[:, None] + cols[None, :]
    if SCATTER:
        tl.store(src_ptrs, tl.load(buf_ptrs, mask=mask), mask=mask)
    else:
        tl.store(buf_ptrs, tl.load(src_ptrs, mask=mask), mask=mask)


def supports(sources: KVSources) -> bool:
    """Whether the kernel can address `sources` (shared strides, whole-element offsets)."""
    return (sources.uniform_strides is not None and sources.element_offsets() is not None
            and sources.dtype.itemsize in _AS_INT)


def buffer_tables(pieces: list[Piece], num_tokens: int, sources: KVSources) -> torch.Tensor:
    """``[2, num_tokens]`` int64: per token, the element offset of its source-0 row in its piece's
    buffer, and the element distance between consecutive sources' rows."""
    out = torch.empty(2, num_tokens, dtype=torch.int64)
    item, hidden, n_src = sources.dtype.itemsize, sources.hidden, sources.num_sources
    for piece in pieces:
        for g in piece.groups:
            tok = torch.arange(g.num_tokens, dtype=torch.int64)
            chunk, pos = tok // g.tokens, tok % g.tokens
            span = slice(g.first_token, g.first_token + g.num_tokens)
            out[0, span] = g.offset // item + chunk * (n_src * g.tokens * hidden) + pos * hidden
            out[1, span] = g.tokens * hidden
    return out


def copy_piece_triton(gather: bool, sources: KVSources, piece: Piece, buffer: torch.Tensor,
                      tables: torch.Tensor, src_offsets: torch.Tensor) -> None:
    """buffer: uint8 ``[>= piece.nbytes]`` on ``sources.device`` laid out like `piece`.
    tables: ``[3, N]`` int64 on the device (slots, then `buffer_tables`) for the whole request.
    src_offsets: ``sources.element_offsets()`` on the device."""
    n = piece.num_tokens
    strides = sources.uniform_strides
    assert strides is not None
    as_int = _AS_INT[sources.dtype.itemsize]
    cols = triton.next_power_of_2(sources.hidden)
    tokens = max(1, min(64, _ELEMENTS_PER_PROGRAM // cols))
    part = tables[:, piece.first_token: piece.first_token + n]
    grid = (triton.cdiv(n, tokens), sources.num_sources)
    _copy_rows_kernel[grid](
        sources.tensors[0].view(as_int), src_offsets, part[0], buffer[: piece.nbytes].view(as_int),
        part[1], part[2], n, sources.block_size, strides[0], strides[1], strides[2],
        sources.head_size, sources.hidden, SCATTER=not gather, TOKENS=tokens, COLS=cols)
