"""CacheGen's data passes on the CPU: native kernels, or the numpy reference with the same results.

`kernels()` returns `NativeKernels` (`lmcache/native/cachegen_kernels.c`: compiled on first use
in the build for the CPU's widest vector path or the one ``LMCACHE_COPY_ISA`` caps it at (see
`lmcache.native`), parallel over pairs / substreams with OpenMP, the GIL released) where a C
compiler is available and ``LMCACHE_NATIVE`` is not 0, else `ReferenceKernels` (the numpy
definitions in `quant` and `rans`). Both produce bit-identical streams and values
(`tests/unit/cachegen/test_cachegen_kernels.py`); the reference is ~50x slower.

Passes, on KV viewed as ``x: [G, T, C]`` (G = 2 * layers (K/V, layer) pairs, CPU, contiguous):
`stats` (channel sums, token sums of squares), `quantize` (symbols, anchor refinements and the
per-channel statistics), `group_ranges` / `layout` (symbol groups and `CodeLayout`, also used by
the decoder), `histogram` (symbol counts per table entry), `normalize` (frequency tables),
`encode` (every substream's rANS words) and `decode` (substreams -> dequantized KV in the output
dtype, one fused pass, into a given buffer if wanted). `encode_chunk` runs every encoder pass
and the steps between them (`quant.step_exponents`, `layout.channel_classes`, ...) in one native
call, each pair's passes back to back while its symbols are in cache (native only; the reference
has no fused form, its caller runs the passes).
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

import numpy as np
import torch

from lmcache import native
from lmcache.cachegen import quant, rans
from lmcache.cachegen.format import MAX_ALPHABET
from lmcache.cachegen.layout import (
    CLASS_THRESHOLDS,
    NUM_CLASSES,
    CodeLayout,
    group_ranges,
)
from lmcache.storage_backend.serde.serde import CorruptBlobError

_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class Quantized(NamedTuple):
    q: np.ndarray  # int16 [G, T, C]
    abs_sum: np.ndarray  # int64 [G, C], sum over tokens of |q|
    qmin: np.ndarray  # int32 [G, C]
    qmax: np.ndarray  # int32 [G, C]
    qpeak: np.ndarray  # int32 [G, T], max |q| of each token
    refine: np.ndarray  # uint8 [A, G, C], the anchor tokens' refinements


class Encoded(NamedTuple):
    payload: bytes  # every substream's words, substream s = b * G + g in order
    lengths: np.ndarray  # int64 [B * G], bytes per substream


class ChunkCode(NamedTuple):
    """One encode call's result: everything its stream holds (`encoder.encode_stream`)."""

    means: np.ndarray  # float32 [G, C], bf16 values
    exps: np.ndarray  # int32 [G, T], step exponents
    refine: np.ndarray  # uint8 [B, G, C], the anchor tokens' refinements
    classes: np.ndarray  # uint8 [G, C]
    low: np.ndarray  # int32 [N], each group's lowest symbol
    size: np.ndarray  # int64 [N], each group's alphabet size
    freqs: np.ndarray  # uint32 [num_symbols], the groups' frequency tables
    encoded: Encoded


class _Scratch(threading.local):
    """Per-thread buffers reused across calls: memory written for the first time costs page
    faults (~3-4 GB/s here), as much as a kernel pass over the same bytes."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buf = self.buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self.buffers[name] = np.empty(max(nbytes, 1), np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)


_scratch = _Scratch()


def coded_input(x: torch.Tensor) -> torch.Tensor:
    """KV [G, T, C] as the kernels read it: CPU, contiguous, bf16 / fp16 / fp32 (fp64 -> fp32)."""
    if x.dtype not in _DTYPE_CODES:
        x = x.float()
    return x.cpu().contiguous()


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels decode into for a requested `dtype` (fp64 goes through fp32)."""
    return dtype if dtype in _DTYPE_CODES else torch.float32


class ReferenceKernels:
    name = "reference"

    def stats(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        return quant.stats_reference(quant.as_float32(x))

    def quantize(self, x: torch.Tensor, means: np.ndarray, inv_steps: np.ndarray,
                 anchors: np.ndarray, reuse: bool = False) -> Quantized:
        return Quantized(*quant.quantize_reference(quant.as_float32(x), means, inv_steps, anchors))

    def group_ranges(self, classes: np.ndarray, qmin: np.ndarray, qmax: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        return group_ranges(classes, qmin, qmax)

    def layout(self, classes: np.ndarray, low: np.ndarray, size: np.ndarray,
               block_starts: np.ndarray) -> CodeLayout:
        return CodeLayout.build(classes, low, size, block_starts)

    def normalize(self, counts: np.ndarray, layout: CodeLayout) -> np.ndarray:
        return rans.normalize(counts, layout)

    def encode_chunk(self, x: torch.Tensor, bins: np.ndarray, block_starts: np.ndarray
                     ) -> ChunkCode | None:
        """No fused encoder: the caller runs the passes (`CacheGenEncoderImpl.code_by_passes`)."""
        return None

    def histogram(self, q: np.ndarray, layout: CodeLayout) -> np.ndarray:
        entries = q.astype(np.int64) + layout.sym_base[:, None, :]
        return np.bincount(entries.reshape(-1), minlength=layout.num_symbols)

    def encode(self, q: np.ndarray, layout: CodeLayout, freq: np.ndarray) -> Encoded:
        streams = rans.encode_reference(q, layout, freq)
        return Encoded(b"".join(s.tobytes() for s in streams),
                       np.array([s.nbytes for s in streams], np.int64))

    def decode(self, payload: bytes | memoryview, lengths: np.ndarray, layout: CodeLayout,
               freq: np.ndarray, means: np.ndarray, steps: np.ndarray, refine: np.ndarray,
               ntok: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        words, offsets, nwords = _words(payload, lengths)
        q = rans.decode_reference(words, offsets, nwords, layout, freq, ntok)
        floats = quant.dequantize_reference(q, means, steps, layout.block_starts[:-1], refine)
        values = torch.from_numpy(floats).to(output_dtype(dtype))
        return values if out is None else out.copy_(values.view(out.shape))


class NativeKernels:
    name = "native"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.path = native.build_of(lib)  # the vector path of its build

    @staticmethod
    def _threads() -> int:
        return max(1, torch.get_num_threads())

    def stats(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        npairs, ntok, nch = x.shape
        colsum = np.empty((npairs, nch), np.float32)
        sumsq = np.empty((npairs, ntok), np.float64)
        rc = self.lib.cg_stats(x.data_ptr(), _DTYPE_CODES[x.dtype], npairs, ntok, nch,
                               _ptr(colsum), _ptr(sumsq), self._threads())
        _check(rc, "cg_stats")
        return colsum, sumsq

    def quantize(self, x: torch.Tensor, means: np.ndarray, inv_steps: np.ndarray,
                 anchors: np.ndarray, reuse: bool = False) -> Quantized:
        """`reuse`: the symbols go to this thread's scratch buffer, valid until its next call."""
        npairs, ntok, nch = x.shape
        q = _scratch.get("q", (npairs, ntok, nch), np.int16) if reuse else \
            np.empty((npairs, ntok, nch), np.int16)
        out = Quantized(q, np.empty((npairs, nch), np.int64),
                        np.empty((npairs, nch), np.int32), np.empty((npairs, nch), np.int32),
                        np.empty((npairs, ntok), np.int32),
                        np.empty((len(anchors), npairs, nch), np.uint8))
        anchor_of = np.full(ntok, -1, np.int64)
        anchor_of[anchors] = np.arange(len(anchors))
        means = np.ascontiguousarray(means, np.float32)
        inv_steps = np.ascontiguousarray(inv_steps, np.float32)
        rc = self.lib.cg_quantize(x.data_ptr(), _DTYPE_CODES[x.dtype], npairs, ntok, nch,
                                  _ptr(means), _ptr(inv_steps), _ptr(anchor_of),
                                  *(_ptr(a) for a in out), self._threads())
        _check(rc, "cg_quantize")
        return out

    def group_ranges(self, classes: np.ndarray, qmin: np.ndarray, qmax: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        npairs, nch = classes.shape
        classes, qmin, qmax = (np.ascontiguousarray(a, t) for a, t in
                               ((classes, np.uint8), (qmin, np.int32), (qmax, np.int32)))
        low = np.empty(npairs * NUM_CLASSES, np.int32)
        size = np.empty(npairs * NUM_CLASSES, np.int64)
        n = self.lib.cg_group_ranges(_ptr(classes), _ptr(qmin), _ptr(qmax), npairs, nch, _ptr(low),
                                     _ptr(size))
        return low[:n], size[:n]

    def layout(self, classes: np.ndarray, low: np.ndarray, size: np.ndarray,
               block_starts: np.ndarray) -> CodeLayout:
        """`CodeLayout.build`; raises ValueError if the classes imply other than len(low) groups."""
        npairs, nch = classes.shape
        classes = np.ascontiguousarray(classes, np.uint8)
        low = np.ascontiguousarray(low, np.int32)
        size = np.ascontiguousarray(size, np.int64)
        if len(low) != len(size):
            raise ValueError(f"{len(low)} symbol lows for {len(size)} sizes")
        per_chan = [np.empty((npairs, nch), np.int64) for _ in range(4)]
        group_of, chans, cchans, sym_base = per_chan
        start = np.empty(len(low), np.int64)
        ncoded, nconst = np.empty(npairs, np.int64), np.empty(npairs, np.int64)
        rc = self.lib.cg_layout(_ptr(classes), npairs, nch, len(low), _ptr(low), _ptr(size),
                                _ptr(start), _ptr(group_of), _ptr(ncoded), _ptr(chans), _ptr(nconst),
                                _ptr(cchans), _ptr(sym_base))
        if rc:
            raise ValueError(f"{len(low)} symbol ranges do not match the groups the classes imply")
        return CodeLayout(np.asarray(block_starts, np.int64), group_of, low, size, start, ncoded,
                          chans, nconst, cchans, sym_base)

    def normalize(self, counts: np.ndarray, layout: CodeLayout) -> np.ndarray:
        counts = np.ascontiguousarray(counts, np.int64)
        freq = np.empty(len(counts), np.uint32)
        if self.lib.cg_normalize(_ptr(counts), len(layout.group_start), _ptr(layout.group_start),
                                 _ptr(layout.group_size), _ptr(freq)):
            raise ValueError("a symbol group has no symbols to count")
        return freq

    def histogram(self, q: np.ndarray, layout: CodeLayout) -> np.ndarray:
        counts = np.zeros(layout.num_symbols, np.int64)
        pair_entries = layout.pair_entries()  # a name keeps it alive during the call
        rc = self.lib.cg_histogram(_ptr(q), *q.shape, _ptr(layout.sym_base), _ptr(pair_entries),
                                   _ptr(counts), self._threads())
        _check(rc, "cg_histogram")
        return counts

    def encode(self, q: np.ndarray, layout: CodeLayout, freq: np.ndarray) -> Encoded:
        npairs, ntok, nch = q.shape
        regions = rans.region_starts(layout.ncoded, layout.block_starts)
        words = _scratch.get("words", (int(regions[-1]),), np.uint32)
        lengths = np.empty(len(regions) - 1, np.int64)
        freq = np.ascontiguousarray(freq, np.uint32)
        total = self.lib.cg_encode(_ptr(q), npairs, ntok, nch, layout.num_blocks,
                                   _ptr(layout.block_starts), _ptr(layout.ncoded),
                                   _ptr(layout.chans), _ptr(layout.sym_base), _ptr(freq),
                                   len(layout.group_start), _ptr(layout.group_start),
                                   _ptr(layout.group_size), _ptr(words), _ptr(regions),
                                   _ptr(lengths), self._threads())
        if total < 0:
            _check(int(total), "cg_encode")
        return Encoded(_payload(words, total), lengths)

    def encode_chunk(self, x: torch.Tensor, bins: np.ndarray, block_starts: np.ndarray
                     ) -> ChunkCode | None:
        """Every pass of the encoder on KV x [G, T, C] (`coded_input`) with bins [G] in token
        blocks at block_starts [B + 1], in one native call, each pair's passes back to back while
        its symbols are in cache: `CacheGenEncoderImpl.code_by_passes`'s results, or None where a
        token's step must be raised to bound its symbols (`quant.bound_exponents`: rare;
        the passes do it). Raises ValueError for non-finite KV or an alphabet past the format's
        limit."""
        npairs, ntok, nch = x.shape
        block_starts = np.ascontiguousarray(block_starts, np.int64)
        nblocks = len(block_starts) - 1
        anchor_of = np.full(ntok, -1, np.int64)
        anchor_of[block_starts[:-1]] = np.arange(nblocks)
        bins = np.ascontiguousarray(bins, np.int64)
        means, exps = np.empty((npairs, nch), np.float32), np.empty((npairs, ntok), np.int32)
        refine = np.empty((nblocks, npairs, nch), np.uint8)
        classes = np.empty((npairs, nch), np.uint8)
        low = np.empty((npairs, NUM_CLASSES), np.int32)
        size = np.empty((npairs, NUM_CLASSES), np.int64)
        ngroups = np.empty(npairs, np.int64)
        # room for any pair's tables (pages never written cost nothing) and any substream
        freqs = _scratch.get("freqs", (npairs * NUM_CLASSES * MAX_ALPHABET,), np.uint32)
        regions = rans.region_starts(np.full(npairs, nch, np.int64), block_starts)
        words = _scratch.get("words", (int(regions[-1]),), np.uint32)
        lengths = np.empty(nblocks * npairs, np.int64)
        total = self.lib.cg_encode_chunk(
            x.data_ptr(), _DTYPE_CODES[x.dtype], npairs, ntok, nch, nblocks, _ptr(block_starts),
            _ptr(anchor_of), _ptr(bins), _ptr(quant.EXP_THRESHOLDS), _ptr(quant.INVERSE_STEPS),
            _ptr(CLASS_THRESHOLDS), _ptr(means), _ptr(exps), _ptr(refine), _ptr(classes),
            _ptr(low), _ptr(size), _ptr(ngroups), _ptr(freqs), _ptr(words), _ptr(regions),
            _ptr(lengths), self._threads())
        if total == -4:
            return None
        if total == -3:
            raise ValueError(quant.NON_FINITE)
        if total == -5:
            raise ValueError("CacheGen symbol range exceeds the format's alphabet limit")
        if total < 0:
            _check(int(total), "cg_encode_chunk")
        used = np.arange(NUM_CLASSES) < ngroups[:, None]
        low, size = low[used], size[used]
        return ChunkCode(means, exps, refine, classes, low, size, freqs[:int(size.sum())].copy(),
                         Encoded(_payload(words, total), lengths))

    def decode(self, payload: bytes | memoryview, lengths: np.ndarray, layout: CodeLayout,
               freq: np.ndarray, means: np.ndarray, steps: np.ndarray, refine: np.ndarray,
               ntok: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        words, offsets, nwords = _words(payload, lengths)
        npairs, nch = layout.group_of.shape
        dtype = output_dtype(dtype)
        direct = out is not None and out.dtype == dtype and out.is_contiguous() and not out.is_cuda
        target = out if direct else torch.empty(npairs, ntok, nch, dtype=dtype)
        assert target is not None
        freq = np.ascontiguousarray(freq, np.uint32)
        means = np.ascontiguousarray(means, np.float32)
        steps = np.ascontiguousarray(steps, np.float32)
        refine = np.ascontiguousarray(refine, np.float32)
        bad = self.lib.cg_decode(
            _ptr(words), _ptr(offsets), _ptr(nwords), npairs, ntok, nch, layout.num_blocks,
            _ptr(layout.block_starts), _ptr(layout.ncoded), _ptr(layout.chans), _ptr(layout.nconst),
            _ptr(layout.cchans), _ptr(layout.group_of), _ptr(layout.group_start),
            _ptr(layout.group_size), _ptr(layout.group_low), _ptr(freq), _ptr(means), _ptr(steps),
            _ptr(refine), target.data_ptr(), _DTYPE_CODES[dtype], self._threads())
        if bad:
            raise CorruptBlobError(f"{bad} cachegen substream(s) do not decode to their symbols "
                                   "(corrupt)")
        return target if out is None or direct else out.copy_(target.view(out.shape))


Kernels = NativeKernels | ReferenceKernels


def kernels(use_native: bool = True, isa: str | None = None) -> Kernels:
    """The native kernels when `use_native` and they can be built, else the numpy reference.
    `isa`: the widest vector path of their build (default: `native.copy_isa()`)."""
    lib = native.load("cachegen_kernels", isa) if use_native else None
    if lib is None:
        return ReferenceKernels()
    native.tune_malloc()
    return NativeKernels(lib)


def _ptr(a: np.ndarray) -> int:
    """The address of `a`'s data; the caller keeps `a` referenced until the native call returns
    (never pass a temporary: its memory may be reused by another thread during the call)."""
    assert a.flags.c_contiguous
    return a.ctypes.data


def _payload(words: np.ndarray, nwords: int) -> bytes:
    """The first `nwords` words of a (scratch) word buffer as bytes."""
    return bytes(memoryview(words.view(np.uint8).data)[:4 * nwords])


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native {what} failed (code {rc})")


def _words(payload: bytes | memoryview, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """payload -> (its uint32 words, in place: `cg_decode` reads them unaligned too; word offset
    and word count of every substream)."""
    words = np.frombuffer(payload, dtype=np.uint32)
    nwords = np.asarray(lengths, np.int64) // 4
    offsets = np.concatenate([[0], np.cumsum(nwords)[:-1]]).astype(np.int64)
    return words, offsets, nwords
