"""Moving a piece's tokens between `KVSources` and a staging buffer with ONE Triton kernel launch.

Program (i, s) moves the rows of ``TOKENS`` consecutive tokens of the piece for source s (K or V
of one layer). Per token, three int64 tables (uploaded once per request) give its slot, where its
source-0 row starts in the buffer and the distance between sources there (the buffer is laid out
like the chunk objects: ``[2L, n_c, hidden]`` per chunk). Source s is addressed as an element offset
from source 0 (all sources share their strides), so any number of per-layer tensors, in any of
the paged / token-major / HF layouts, is one launch. Values move as integers of the same width
(bit-exact for every dtype). Negative slots are skipped (scatter only; a gather never has them).

A program's tile is ``[TOKENS * HEADS, HEAD_DIM]``: one row per (token, head), each row one run
of ``head_size`` contiguous elements in the cache (HF caches keep a token's heads ``T * D`` apart,
vLLM's paged caches side by side). Addressing a row as ``row start + arange(HEAD_DIM)`` lets Triton
see the contiguity, and where every row start is a multiple of 16 bytes (`vector_width` checks the
strides, offsets and tables on the host) the kernel says so (``tl.multiple_of`` /
``tl.max_contiguous`` on the 2-D offsets: hints on the 1-D row starts alone left single-head tiles
scalar) and each thread moves 16-byte vectors. Issue 36's first device run used one column index
per element (``col // head_size * head_stride + col % head_size``), which hides the contiguity:
its PTX for sm_90 (compiled ahead of time on a CPU machine, `triton.compile` with
``GPUTarget("cuda", 90, 32)``) has 64 ``ld.global.b16`` / ``st.global.b16`` per thread; this
kernel's has 8 ``ld.global.v4.b32`` / ``st.global.v4.b32`` for the same 8,192-element tile.
Requests at 11 GB/s (70B/TP8 rows of 1 KV head x 128) and ~44 GB/s (8B-like) were kernel-bound.

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
_VECTOR_BYTES = 16


@triton.jit
def _copy_rows_kernel(src, src_offsets, slots, buf, row_offsets, source_strides, num_tokens,
                      block_size, block_stride, token_stride, head_stride, num_heads,
                      SCATTER: tl.constexpr, TOKENS: tl.constexpr, HEADS: tl.constexpr,
                      HEAD_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, VEC: tl.constexpr):
    r = tl.arange(0, TOKENS * HEADS)
    t = tl.program_id(0) * TOKENS + r // HEADS
    h = r % HEADS
    s = tl.program_id(1)
    live = (t < num_tokens) & (h < num_heads)
    slot = tl.load(slots + t, mask=live, other=-1)
    block = slot // block_size
    src_row = tl.load(src_offsets + s) + block * block_stride \
        + (slot - block * block_size) * token_stride + h * head_stride
    buf_row = tl.load(row_offsets + t, mask=live, other=0) \
        + s * tl.load(source_strides + t, mask=live, other=0) + h * HEAD_SIZE
    d = tl.arange(0, HEAD_DIM)
    mask = (live & (slot >= 0))[:, None] & (d < HEAD_SIZE)[None, :]
    src_off = src_row[:, None] + d[None, :]
    buf_off = buf_row[:, None] + d[None, :]
    if VEC > 1:  # every row starts on a 16-byte boundary (checked on the host): vector accesses
        src_off = tl.max_contiguous(tl.multiple_of(src_off, [1, VEC]), [1, VEC])
        buf_off = tl.max_contiguous(tl.multiple_of(buf_off, [1, VEC]), [1, VEC])
    src_ptrs = src + src_off
    buf_ptrs = buf + buf_off
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


def vector_width(sources: KVSources, tables: torch.Tensor) -> int:
    """Elements per 16-byte vector if every row start the kernel computes for this request is a
    multiple of it (source addresses and strides, the buffer tables ``tables[1:]`` (CPU), the
    head size), else 1 (scalar accesses: always correct)."""
    vec = max(1, _VECTOR_BYTES // sources.dtype.itemsize)
    strides, offsets = sources.uniform_strides, sources.element_offsets()
    if vec == 1 or strides is None or offsets is None:
        return 1
    used = [strides[0], strides[1], strides[2] if sources.num_heads > 1 else 0, sources.head_size]
    aligned = (sources.tensors[0].data_ptr() % _VECTOR_BYTES == 0
               and all(x % vec == 0 for x in used) and bool((offsets % vec == 0).all())
               and bool((tables[1:] % vec == 0).all()))
    return vec if aligned else 1


def copy_piece_triton(gather: bool, sources: KVSources, piece: Piece, buffer: torch.Tensor,
                      tables: torch.Tensor, src_offsets: torch.Tensor, vec: int = 1) -> None:
    """buffer: uint8 ``[>= piece.nbytes]`` on ``sources.device`` laid out like `piece`.
    tables: ``[3, N]`` int64 on the device (slots, then `buffer_tables`) for the whole request.
    src_offsets: ``sources.element_offsets()`` on the device. vec: `vector_width` of the request."""
    n = piece.num_tokens
    strides = sources.uniform_strides
    assert strides is not None
    if buffer.data_ptr() % _VECTOR_BYTES:
        vec = 1
    as_int = _AS_INT[sources.dtype.itemsize]
    heads = triton.next_power_of_2(sources.num_heads)
    head_dim = triton.next_power_of_2(sources.head_size)
    tokens = max(1, min(128, _ELEMENTS_PER_PROGRAM // (heads * head_dim)))
    part = tables[:, piece.first_token: piece.first_token + n]
    grid = (triton.cdiv(n, tokens), sources.num_sources)
    _copy_rows_kernel[grid](
        sources.tensors[0].view(as_int), src_offsets, part[0], buffer[: piece.nbytes].view(as_int),
        part[1], part[2], n, sources.block_size, strides[0], strides[1],
        strides[2] if sources.num_heads > 1 else 0, sources.num_heads, SCATTER=not gather,
        TOKENS=tokens, HEADS=heads, HEAD_SIZE=sources.head_size, HEAD_DIM=head_dim, VEC=vec)
