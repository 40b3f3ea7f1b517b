"""CacheGen encoder: KV -> quantized symbols -> entropy-coded token blocks (CPU coder).

Pipeline of `encode_stream(kv [2, L, T, C], key_bins, value_bins, chunk_size)`:

1. `CacheGenEncoderImpl.quantize()`: per-channel means, per-token step exponents (anchor tokens
   finer), int16 symbols with per-channel statistics (`quant`; the data passes run in `kernels`,
   native or numpy reference).
2. `CacheGenEncoderImpl.compute_cdf(is_key)`: channel classes, symbol groups and one frequency
   table per (pair, class) group (`layout`, `rans.normalize`), counted on every symbol.
3. Token blocks of `chunk_size` tokens are entropy-coded independently, one interleaved-rANS
   substream per (block, pair) (`rans`), in parallel.

`CacheGenEncoderImpl.code()` runs all three: with the native kernels in one fused pass over each
(K/V, layer) pair while its data is in cache (`NativeKernels.encode_chunk`), else step by step
(`code_by_passes`); both give the same stream. `code_blocks` returns the coder's arrays (what the
serializer packs, `serde`), `encode_stream` the flat encoder output (`encoded`).

The CUDA coder (`gpu`) quantizes the same way but codes with nvCOMP; the serializer picks it where
CUDA and nvCOMP are present.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmcache.cachegen import format as fmt
from lmcache.cachegen import quant
from lmcache.cachegen.config import MAX_BINS
from lmcache.cachegen.encoded import CacheGenEncoderOutput
from lmcache.cachegen.format import MAX_ALPHABET
from lmcache.cachegen.kernels import ChunkCode, Kernels, Quantized, coded_input
from lmcache.cachegen.kernels import kernels as default_kernels
from lmcache.cachegen.layout import CodeLayout, channel_classes

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what it encodes
Bins = Sequence[int] | torch.Tensor | np.ndarray  # one entry per layer


@dataclass
class SymbolTables:
    """`CacheGenEncoderImpl.compute_cdf`'s result for a set of (K/V, layer) pairs."""

    layout: CodeLayout
    classes: np.ndarray  # uint8 [pairs, C]
    freqs: np.ndarray  # uint32 [num_symbols], each group's table summing to 2**12


class CacheGenEncoderImpl:
    """One encode call's state. The KV comes as `kv` ([2, L, T, C] float, any device) or as `fp_k`,
    `fp_v` ([L, T, C] each); `key_bins`, `value_bins`: [L] bins each; `block_tokens`: token block
    sizes (default one block); `kernels`: the CPU kernels (`kernels.kernels()` by default);
    `reuse_buffers`: the symbols live in a per-thread scratch buffer, valid until the thread's next
    encode (what `encode_stream` does, as it is done with them when it returns).

    Keyword arguments only, as the seed's ``CacheGenEncoderImpl(**kwargs)``; raises ValueError for
    a KV shape, bins or block sizes that do not fit together."""

    def __init__(self, *, kv: torch.Tensor | None = None, fp_k: torch.Tensor | None = None,
                 fp_v: torch.Tensor | None = None, key_bins: Bins, value_bins: Bins,
                 block_tokens: Sequence[int] | None = None, kernels: Kernels | None = None,
                 reuse_buffers: bool = False) -> None:
        kv = _stacked(kv, fp_k, fp_v)
        two, nlayers, ntok, nch = kv.shape
        self.nlayers: int = nlayers
        self.x = coded_input(kv.reshape(two * nlayers, ntok, nch))
        self.key_bins = _layer_bins("key_bins", key_bins, nlayers)
        self.value_bins = _layer_bins("value_bins", value_bins, nlayers)
        self.block_starts = _block_starts([ntok] if block_tokens is None else block_tokens, ntok)
        self.kernels: Kernels = kernels or default_kernels()
        self.reuse = reuse_buffers
        self.means = np.empty(0, np.float32)
        self.exps = np.empty(0, np.int32)
        self.refinements = np.empty(0, np.uint8)
        self.quantized: Quantized | None = None

    def quantize(self) -> Quantized:
        """Sets means float32 [2L, C], exps int32 [2L, T], the symbols (`Quantized`, anchor rows
        coarse) and the anchors' refinements uint8 [B, 2L, C]."""
        x, k = self.x, self.kernels
        colsum, sumsq = k.stats(x)
        if not np.isfinite(colsum).all():
            raise ValueError(quant.NON_FINITE)
        self.means = quant.channel_means(colsum, x.shape[1])
        bins = np.concatenate([self.key_bins, self.value_bins])
        self.exps = quant.step_exponents(sumsq, x.shape[2], bins)
        anchors = self.block_starts[:-1]
        quantized = k.quantize(x, self.means, quant.inverse_steps(self.exps), anchors, self.reuse)
        if int(quantized.qpeak.max()) >= quant.QMAX:
            self.exps = quant.bound_exponents(quant.as_float32(x), self.means, self.exps)
            quantized = k.quantize(x, self.means, quant.inverse_steps(self.exps), anchors, self.reuse)
        self.refinements = quantized.refine
        self.quantized = quantized
        return quantized

    def compute_cdf(self, is_key: bool | None = None) -> SymbolTables:
        """Channel classes, symbol groups and their frequency tables of the K pairs
        (is_key=True), the V pairs (False) or all 2L pairs (None, K first: what the stream holds)."""
        qz = self.quantized or self.quantize()
        pairs = slice(None) if is_key is None else \
            (slice(0, self.nlayers) if is_key else slice(self.nlayers, None))
        k = self.kernels
        classes = channel_classes(qz.abs_sum[pairs], self.x.shape[1])
        low, size = k.group_ranges(classes, qz.qmin[pairs], qz.qmax[pairs])
        if int(size.max()) > MAX_ALPHABET:
            raise ValueError("CacheGen symbol range exceeds the format's alphabet limit")
        layout = k.layout(classes, low, size, self.block_starts)
        return SymbolTables(layout, classes, k.normalize(k.histogram(qz.q[pairs], layout), layout))

    def code(self) -> ChunkCode:
        """Every pass at once: in the kernels' fused encoder where they have one, else (or where
        it declines) `code_by_passes`; the same results either way."""
        bins = np.concatenate([self.key_bins, self.value_bins])
        fused = self.kernels.encode_chunk(self.x, bins, self.block_starts)
        return fused if fused is not None else self.code_by_passes()

    def code_by_passes(self) -> ChunkCode:
        """`quantize`, `compute_cdf` (all pairs) and the kernels' `encode`."""
        qz = self.quantized or self.quantize()
        tables = self.compute_cdf()
        layout = tables.layout
        return ChunkCode(self.means, self.exps, self.refinements, tables.classes, layout.group_low,
                         layout.group_size, tables.freqs,
                         self.kernels.encode(qz.q, layout, tables.freqs))


def _stacked(kv: torch.Tensor | None, fp_k: torch.Tensor | None, fp_v: torch.Tensor | None
             ) -> torch.Tensor:
    """`kv`, or `fp_k` and `fp_v` stacked, checked to be float KV [2, L, T, C]."""
    if kv is None:
        if fp_k is None or fp_v is None:
            raise ValueError("CacheGenEncoderImpl needs kv [2, L, T, C] or both fp_k and fp_v [L, T, C]")
        if fp_k.shape != fp_v.shape:
            raise ValueError(f"fp_k {tuple(fp_k.shape)} and fp_v {tuple(fp_v.shape)} differ in shape")
        kv = torch.stack([fp_k, fp_v])
    elif fp_k is not None or fp_v is not None:
        raise ValueError("CacheGenEncoderImpl takes kv or fp_k and fp_v, not both")
    check_kv(kv, kv.shape[1] if kv.dim() == 4 else 0, 1)
    return kv


def _layer_bins(name: str, bins: Bins, nlayers: int) -> np.ndarray:
    """[L] bins -> int64 array; raises ValueError for another length or bins outside [2, MAX_BINS]."""
    out = np.asarray(torch.as_tensor(bins).reshape(-1), np.int64)
    if len(out) != nlayers:
        raise ValueError(f"{name} has {len(out)} entries for {nlayers} layers")
    if not 2 <= int(out.min()) <= int(out.max()) <= MAX_BINS:
        raise ValueError(f"{name} {out.tolist()} must each be in [2, {MAX_BINS}]")
    return out


def _block_starts(block_tokens: Sequence[int], ntok: int) -> np.ndarray:
    """Token block sizes -> int64 block boundaries [B + 1]; they must be >= 1 and add up to ntok."""
    sizes = np.asarray(block_tokens, np.int64).reshape(-1)
    if len(sizes) == 0 or int(sizes.min()) < 1 or int(sizes.sum()) != ntok:
        raise ValueError(f"block_tokens {sizes.tolist()[:8]} must be >= 1 each and add up to T={ntok}")
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def encode_stream(kv: torch.Tensor, key_bins: torch.Tensor, value_bins: torch.Tensor,
                  chunk_size: int, coder: Kernels | None = None) -> CacheGenEncoderOutput:
    """Encode kv [2, L, T, C] (any float dtype; CPU, or CUDA whose data is moved to the host) in
    independent token blocks of `chunk_size` tokens with the CPU rANS coder (native kernels, or
    the reference `coder` given). Returns the flat encoder output (num_heads=1, head_size=C)."""
    ntok = kv.shape[2]
    blocks = [min(chunk_size, ntok - t0) for t0 in range(0, ntok, chunk_size)]
    code = code_blocks(kv, key_bins, value_bins, blocks, coder)
    lengths = code.encoded.lengths.reshape(len(blocks), -1)
    starts = np.zeros((len(blocks), lengths.shape[1] + 1), np.int64)
    np.cumsum(lengths, axis=1, out=starts[:, 1:])
    starts += np.r_[0, np.cumsum(starts[:-1, -1])][:, None]  # blocks one after another
    nlayers = kv.shape[1]
    exps = torch.from_numpy(code.exps.astype(np.int16)).reshape(2, nlayers, ntok)
    return CacheGenEncoderOutput(
        code.encoded.payload, torch.from_numpy(starts),
        torch.from_numpy(code.freqs.astype(np.int32)), exps[0], exps[1], 1, kv.shape[3],
        channel_means=torch.from_numpy(code.means).to(torch.bfloat16).reshape(2, nlayers, -1),
        channel_classes=torch.from_numpy(code.classes).reshape(2, nlayers, -1),
        symbol_ranges=torch.from_numpy(np.stack([code.low, code.size], 1).astype(np.int32)),
        key_bins=torch.as_tensor(key_bins, dtype=torch.int32),
        value_bins=torch.as_tensor(value_bins, dtype=torch.int32),
        block_tokens=torch.tensor(blocks, dtype=torch.int64), coder=fmt.CODER_RANS,
        anchor_refinements=torch.from_numpy(code.refine))


def code_blocks(kv: torch.Tensor, key_bins: torch.Tensor, value_bins: torch.Tensor, blocks: list[int],
                coder: Kernels | None) -> ChunkCode:
    """kv [2, L, T, C] coded in token blocks of the given sizes (CPU rANS coder)."""
    impl = CacheGenEncoderImpl(kv=kv, key_bins=key_bins, value_bins=value_bins,
                               block_tokens=blocks, kernels=coder, reuse_buffers=True)
    return impl.code()


def check_kv(kv: torch.Tensor, nlayers: int, chunk_size: int) -> None:
    """Raise ValueError unless kv is float KV [2, nlayers, T, C] and chunk_size >= 1."""
    if kv.dim() != 4 or kv.shape[0] != 2 or min(kv.shape) < 1:
        raise ValueError(f"CacheGen encodes KV of shape [2, L, T, C]; got {tuple(kv.shape)}")
    if kv.dtype not in FLOAT_DTYPES:
        raise ValueError(f"CacheGen encodes floating-point KV; got {kv.dtype}")
    if kv.shape[1] != nlayers:
        raise ValueError(f"KV has {kv.shape[1]} layers, CacheGen config has {nlayers}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
