"""The versioned binary format of a CacheGen stream (no pickle; all integers little-endian).

A stream encodes KV of shape ``[2, L, T, C]`` (C = num_heads * head_size) cut into token blocks.
Layout, in order (``G = 2 * L`` (K/V, layer) pairs, ``B`` blocks, ``N`` symbol groups):

    field            type / count           meaning
    magic            4 bytes  b"CGEN"
    version          u8 (2)
    coder            u8       which entropy coder wrote the payload: 1 rANS (CPU kernels,
                              `rans`), 3 nvCOMP ANS with a symbol checksum (CUDA, `gpu`);
                              2 (nvCOMP before the checksum) is stale
    nlayers          u16      L
    num_heads        u16
    head_size        u16
    ntokens          u32      T
    nblocks          u32      B
    ngroups          u32      N (0 for coder 3)
    key_bins         u16[L]   bins per layer (informational; decoding uses the step exponents)
    value_bins       u16[L]
    block_tokens     u32[B]   tokens per block (sum = T)
    channel_means    bf16[G*C]            per (K/V, layer, channel) mean (finite), subtracted
                                          before quantization
    exp_base         i16[G]               step exponents e[g, t] = exp_base[g] + exp_offset[g, t]
    exp_offset       i8[G*T]              (step = 2 ** (e / 8), see quant; e in
                                          [EXP_MIN, EXP_LIMIT])
  coder 1 (rANS):
    anchor_refine    u8[ceil(B*G*C*3/8)]  3-bit refinement of each block's first token
                                          ([B, G, C], packed most significant bit first)
    channel_classes  u8[ceil(G*C/2)]      4-bit class per channel, low nibble first
    group_low        i16[N]               lowest symbol of each group
    group_size       u16[N]               alphabet size n of each group (1..4095)
    frequencies      u16[sum n]           each group's table, summing to 2**12 (rans)
    stream_lengths   u32[B*G]             byte length of substream (block b, pair g)
    payload          bytes                the substreams, block-major, then pair order
  coder 3 (nvCOMP):
    symbol_checksum  u64                  `gpu.symbol_checksum` of the symbols the payload must
                                          decode to (nvCOMP does not check its container's sizes)
    payload          bytes                nvCOMP's ANS container of the symbols (gpu)

Groups are implied by the classes (`layout`; `N` must match). `unpack` checks every size
against the header and raises `CorruptBlobError` for anything inconsistent; streams of format
version 1 (constriction's coder, before rANS) raise its subclass `StaleStreamError`: a miss, and
the store replaces the value.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np
import torch

from lmcache.cachegen.quant import EXP_LIMIT, EXP_MIN
from lmcache.storage_backend.serde.serde import CorruptBlobError, ForeignSerdeError

MAGIC = b"CGEN"
VERSION = 2
CODER_RANS = 1
CODER_NVCOMP = 3
CODER_NVCOMP_UNCHECKED = 2  # issue 36's first device run only: no symbol checksum (stale)
CODERS = {CODER_RANS: "rANS (CPU)", CODER_NVCOMP: "nvCOMP ANS (CUDA)"}
MAX_ALPHABET = 4095
_HEAD = struct.Struct("<4sBBHHHIII")


class StaleStreamError(CorruptBlobError):
    """A CacheGen stream of an older format version, which this release does not decode."""


class UnavailableCoderError(ForeignSerdeError):
    """A valid CacheGen stream whose coder cannot run here (an nvCOMP stream without CUDA or
    nvCOMP): a miss, but the value is kept for readers that can decode it."""


def pack(out: Any) -> bytes:
    """Serialize a `CacheGenEncoderOutput` (fields as documented in `encoded`)."""
    return b"".join(pack_parts(out))


class RansTables(NamedTuple):
    """A rANS-coded stream's fields after the exponents (numpy, any integer dtypes)."""

    refine: np.ndarray  # [B, G, C] anchor refinements (< 8)
    classes: np.ndarray  # [G, C] channel classes (< 16)
    low: np.ndarray  # [N] each group's lowest symbol
    size: np.ndarray  # [N] each group's alphabet size
    freqs: np.ndarray  # [sum size] the groups' frequency tables
    lengths: np.ndarray  # [B * G] bytes of each substream


def pack_parts(out: Any) -> list[bytes | memoryview]:
    """`pack`'s bytes as [everything before the substreams, the substreams] (the encoder's
    payload is not copied)."""
    nlayers, ntokens = out.max_tensors_key.shape
    exps = torch.stack([out.max_tensors_key, out.max_tensors_value]).reshape(2 * nlayers, ntokens)
    tables = None
    if out.coder == CODER_RANS:
        ranges = _np(out.symbol_ranges.to(torch.int64).reshape(-1, 2))
        tables = RansTables(_np(out.anchor_refinements), _np(out.channel_classes), ranges[:, 0],
                            ranges[:, 1], _np(out.cdf), _np(out.start_indices.long().diff(dim=1)))
    return pack_fields(out.coder, out.num_heads, out.head_size, _np(out.key_bins),
                       _np(out.value_bins), _np(out.block_tokens),
                       _np(out.channel_means.to(torch.bfloat16).view(torch.int16)), _np(exps),
                       tables, out.bytestream, getattr(out, "symbol_checksum", 0))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def pack_fields(coder: int, num_heads: int, head_size: int, key_bins: np.ndarray,
                value_bins: np.ndarray, block_tokens: np.ndarray, means: np.ndarray,
                exps: np.ndarray, tables: RansTables | None, payload: bytes | memoryview,
                symbol_checksum: int = 0) -> list[bytes | memoryview]:
    """`pack_parts` from numpy fields: means [G, C] as bf16 bit patterns (int16 / uint16), exps
    [G, T] step exponents, `tables` for coder 1 (None for coder 3), payload: the coded bytes,
    symbol_checksum: coder 3's (unsigned 64-bit)."""
    nlayers, ntokens = len(key_bins), exps.shape[1]
    if max(nlayers, num_heads, head_size) > 0xFFFF or ntokens > 0xFFFFFFFF:
        raise ValueError(f"KV too large for the cachegen format: L={nlayers}, "
                         f"heads={num_heads}, head_size={head_size}, T={ntokens}")
    base = exps.max(axis=1, keepdims=True).astype(np.int64) - 127
    offsets = exps - base
    if int(offsets.min()) < -128:
        raise ValueError("step exponents of one layer span more than 255 codes")
    parts = [
        _HEAD.pack(MAGIC, VERSION, coder, nlayers, num_heads, head_size, ntokens,
                   len(block_tokens), 0 if tables is None else len(tables.low)),
        _arr(key_bins, np.uint16), _arr(value_bins, np.uint16), _arr(block_tokens, np.uint32),
        _arr(means, np.int16), _arr(base, np.int16), _arr(offsets, np.int8),
    ]
    if tables is not None:
        classes = tables.classes.reshape(-1).astype(np.uint8)
        if classes.size % 2:
            classes = np.append(classes, np.uint8(0))
        parts += [_pack3(tables.refine.reshape(-1)), (classes[0::2] | (classes[1::2] << 4)).tobytes(),
                  _arr(tables.low, np.int16), _arr(tables.size, np.uint16),
                  _arr(tables.freqs, np.uint16), _arr(tables.lengths, np.uint32)]
    elif coder == CODER_NVCOMP:
        parts.append(struct.pack("<Q", symbol_checksum))
    return [b"".join(parts), payload]


_SHIFTS3 = np.arange(21, -1, -3, dtype=np.uint32)  # 8 values of 3 bits in 3 bytes, first value highest


def _pack3(values: np.ndarray) -> bytes:
    """3-bit values (uint8 < 8) -> ceil(3 n / 8) bytes, most significant bit first."""
    n = len(values)
    padded = np.zeros(-(-n // 8) * 8, np.uint32)
    padded[:n] = values
    word = (padded.reshape(-1, 8) << _SHIFTS3).sum(axis=1, dtype=np.uint32)
    return np.stack([word >> 16, word >> 8, word], axis=1).astype(np.uint8).tobytes()[:(3 * n + 7) // 8]


def _unpack3(data: np.ndarray, n: int) -> np.ndarray:
    """`_pack3`'s inverse: the first n values (uint8)."""
    padded = np.zeros(-(-len(data) // 3) * 3, np.uint32)
    padded[:len(data)] = data
    b = padded.reshape(-1, 3)
    word = b[:, 0] << 16 | b[:, 1] << 8 | b[:, 2]
    return ((word[:, None] >> _SHIFTS3) & 7).astype(np.uint8).reshape(-1)[:n]


def _arr(a: np.ndarray, dtype: type) -> bytes:
    return np.asarray(a).astype(dtype, copy=False).tobytes()


class _Reader:
    def __init__(self, bs: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(bs).cast("B")
        self.pos = 0

    def take(self, count: int, dtype: type, what: str) -> np.ndarray:
        nbytes = count * np.dtype(dtype).itemsize
        if self.pos + nbytes > len(self.buf):
            raise CorruptBlobError(f"cachegen stream truncated in {what} "
                                   f"(needs {nbytes} bytes at offset {self.pos}, has {len(self.buf)})")
        arr: np.ndarray = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += nbytes
        return arr


def unpack(bs: bytes | bytearray | memoryview, view: bool = False) -> dict[str, Any]:
    """The fields of a `CacheGenEncoderOutput`; raises CorruptBlobError for invalid bytes.
    `view`: a rANS stream's `bytestream` is a view of `bs` rather than a copy (for a caller that
    decodes it before `bs` changes)."""
    if len(bs) < 6:
        raise CorruptBlobError(f"cachegen stream of {len(bs)} bytes is shorter than its header")
    magic, fmt_version = bytes(bs[:4]), bs[4]
    if magic != MAGIC:
        raise CorruptBlobError("not a cachegen stream (bad magic)")
    if fmt_version < VERSION:
        raise StaleStreamError(f"cachegen stream of format version {fmt_version} (before the rANS "
                               f"coder); this release reads version {VERSION}")
    if fmt_version != VERSION:
        raise CorruptBlobError(f"unsupported cachegen stream version {fmt_version}")
    if len(bs) < _HEAD.size:
        raise CorruptBlobError(f"cachegen stream of {len(bs)} bytes is shorter than its header")
    _, _, coder, nlayers, heads, head_size, ntokens, nblocks, ngroups = _HEAD.unpack_from(bs)
    if coder == CODER_NVCOMP_UNCHECKED:
        raise StaleStreamError("nvCOMP-coded cachegen stream without a symbol checksum (written "
                               "before issue 36's fix); this release does not decode it")
    if coder not in CODERS:
        raise CorruptBlobError(f"unknown cachegen coder id {coder}")
    if min(nlayers, heads, head_size, ntokens, nblocks) < 1 or nblocks > ntokens:
        raise CorruptBlobError(f"bad cachegen dims L={nlayers} heads={heads} head_size={head_size} "
                               f"T={ntokens} blocks={nblocks}")
    pairs, channels = 2 * nlayers, heads * head_size
    r = _Reader(bs)
    r.pos = _HEAD.size
    key_bins = r.take(nlayers, np.uint16, "key_bins")
    value_bins = r.take(nlayers, np.uint16, "value_bins")
    block_tokens = r.take(nblocks, np.uint32, "block_tokens")
    if int(block_tokens.min()) < 1 or int(block_tokens.sum(dtype=np.int64)) != ntokens:
        raise CorruptBlobError(f"block sizes {block_tokens.tolist()[:8]}... do not add up to T={ntokens}")
    means = r.take(pairs * channels, np.int16, "channel_means")
    base = r.take(pairs, np.int16, "exp_base").astype(np.int16)
    offsets = r.take(pairs * ntokens, np.int8, "exp_offset").reshape(pairs, ntokens)
    fields = dict(
        coder=coder, num_heads=heads, head_size=head_size,
        channel_means=torch.from_numpy(means.copy()).view(torch.bfloat16).reshape(2, nlayers, channels),
        key_bins=torch.from_numpy(key_bins.astype(np.int32)),
        value_bins=torch.from_numpy(value_bins.astype(np.int32)),
        block_tokens=torch.from_numpy(block_tokens.astype(np.int64)),
    )
    if not bool(torch.isfinite(fields["channel_means"]).all()):
        raise CorruptBlobError("cachegen channel means are not all finite")
    exps = torch.from_numpy(base[:, None] + offsets.astype(np.int16)).reshape(2, nlayers, ntokens)
    if int(exps.min()) < EXP_MIN or int(exps.max()) > EXP_LIMIT:  # steps past 2**127 are inf
        raise CorruptBlobError(f"cachegen step exponents [{int(exps.min())}, {int(exps.max())}] "
                               f"outside the encoders' [{EXP_MIN}, {EXP_LIMIT}]")
    fields.update(max_tensors_key=exps[0].clone(), max_tensors_value=exps[1].clone())
    if coder == CODER_NVCOMP:
        if ngroups:
            raise CorruptBlobError(f"an nvCOMP-coded stream has no symbol groups, header says {ngroups}")
        (checksum,) = r.take(1, np.uint64, "symbol_checksum")
        # a view, not a copy: the payload goes straight to pinned memory and the device
        fields.update(bytestream=r.buf[r.pos:], symbol_checksum=int(checksum),
                      start_indices=torch.tensor([[0, len(r.buf) - r.pos]], dtype=torch.int64),
                      cdf=torch.empty(0, dtype=torch.int32),
                      channel_classes=torch.empty(0, dtype=torch.uint8),
                      symbol_ranges=torch.empty(0, 2, dtype=torch.int32))
        return fields
    nrefine = nblocks * pairs * channels
    refine = _unpack3(r.take((3 * nrefine + 7) // 8, np.uint8, "anchor_refine"), nrefine)
    packed = r.take((pairs * channels + 1) // 2, np.uint8, "channel_classes")
    nibbles = np.empty(packed.size * 2, dtype=np.uint8)
    nibbles[0::2], nibbles[1::2] = packed & 15, packed >> 4
    classes = nibbles[: pairs * channels].reshape(pairs, channels)
    present = np.zeros((pairs, 16), bool)
    present[np.arange(pairs)[:, None], classes] = True
    if ngroups != int(present.sum()):
        raise CorruptBlobError(f"header says {ngroups} symbol groups, the classes imply {int(present.sum())}")
    low = r.take(ngroups, np.int16, "group_low")
    size = r.take(ngroups, np.uint16, "group_size")
    if ngroups and (int(size.min()) < 1 or int(size.max()) > MAX_ALPHABET):
        raise CorruptBlobError(f"symbol alphabet sizes must be in [1, {MAX_ALPHABET}]")
    if ngroups and int((low.astype(np.int64) + size).max()) > 32768:  # the coders' int16 symbols
        raise CorruptBlobError("a symbol group reaches past the 16-bit symbol range")
    freqs = r.take(int(size.sum(dtype=np.int64)), np.uint16, "frequencies")
    lengths = r.take(nblocks * pairs, np.uint32, "stream_lengths").astype(np.int64)
    if np.any(lengths % 4):
        raise CorruptBlobError("substream lengths must be whole 32-bit words")
    total = int(lengths.sum())
    if r.pos + total != len(r.buf):
        raise CorruptBlobError(f"cachegen payload has {len(r.buf) - r.pos} bytes, "
                               f"the substream lengths say {total}")
    starts = np.concatenate([np.zeros((nblocks, 1), np.int64),
                             np.cumsum(lengths.reshape(nblocks, pairs), axis=1)], axis=1)
    starts += np.r_[0, np.cumsum(lengths.reshape(nblocks, pairs).sum(1))[:-1]][:, None]
    fields.update(
        bytestream=r.buf[r.pos:] if view else bytes(r.buf[r.pos:]),
        start_indices=torch.from_numpy(starts),
        cdf=torch.from_numpy(freqs.astype(np.int32)),
        channel_classes=torch.from_numpy(classes.copy()).reshape(2, nlayers, channels),
        symbol_ranges=torch.from_numpy(np.stack([low.astype(np.int32), size.astype(np.int32)], 1)),
        anchor_refinements=torch.from_numpy(refine.reshape(nblocks, pairs, channels)),
    )
    return fields
