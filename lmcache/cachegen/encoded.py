"""CacheGen's encoder output in memory (seed 003 names), in two forms of the same content.

`CacheGenGPUEncoderOutput` keeps the entropy-coded data as one `CacheGenGPUBytestream` per token
block (uint8 tensors; blocks decode independently); `CacheGenEncoderOutput` holds all blocks in
one `bytes` object with `start_indices` (byte offsets) — the form written to the wire. `to_flat`
/ `to_gpu_output` convert between them; both `to_bytes` / `from_bytes` use the versioned format
of `format`.

The seed's fields, with these meanings:

- `cdf`: the frequency tables of all symbol groups, concatenated (int32; each group's sums to
  2**12, `rans`); a group is (K/V, layer, channel class) (`layout`); `symbol_ranges[g] =
  (lowest symbol, alphabet size)`.
- `max_tensors_key` / `max_tensors_value`: the per-token scales, as step exponents
  ``e`` (int16, ``step = 2 ** (e / 8)``), shape ``[nlayers, ntokens]``.

and extra fields: `channel_means` (bf16 ``[2, nlayers, hidden]``), `channel_classes` (uint8
``[2, nlayers, hidden]``), `symbol_ranges` (int32 ``[ngroups, 2]``), `key_bins` / `value_bins`
(the bins used, int32 ``[nlayers]``), `anchor_refinements` (uint8 ``[nblocks, 2 * nlayers,
hidden]``: the 3 extra bits of each block's first token, `quant`), `coder` (which entropy coder
wrote the data: `format.CODER_RANS` or `CODER_NVCOMP`; nvCOMP streams have no classes or tables),
`symbol_checksum` (nvCOMP streams: `gpu.symbol_checksum` of the symbols the payload must decode
to, as an unsigned 64-bit int; 0 for rANS streams).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmcache.cachegen import format as fmt


@dataclass
class CacheGenGPUBytestream:
    """One token block's entropy-coded data: `bytestream` (uint8) is the concatenation of one
    substream per (K/V, layer), whose byte lengths are `bytestream_lengths` (int64 ``[2 *
    nlayers]``); `ntokens` tokens."""

    bytestream: torch.Tensor
    bytestream_lengths: torch.Tensor
    ntokens: int


@dataclass
class CacheGenGPUEncoderOutput:
    data_chunks: list[CacheGenGPUBytestream]
    cdf: torch.Tensor
    max_tensors_key: torch.Tensor
    max_tensors_value: torch.Tensor
    num_heads: int
    head_size: int
    channel_means: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    channel_classes: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    symbol_ranges: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    key_bins: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    value_bins: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    coder: int = fmt.CODER_RANS
    anchor_refinements: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    symbol_checksum: int = 0

    @property
    def ntokens(self) -> int:
        return sum(c.ntokens for c in self.data_chunks)

    def to_flat(self) -> CacheGenEncoderOutput:
        streams = [c.bytestream.cpu().numpy().tobytes() for c in self.data_chunks]
        lengths = torch.stack([c.bytestream_lengths.cpu().long() for c in self.data_chunks])
        starts = torch.cat([torch.zeros(len(streams), 1, dtype=torch.long), lengths.cumsum(1)], 1)
        starts += torch.tensor([0, *[len(s) for s in streams]]).cumsum(0)[:-1, None]
        return CacheGenEncoderOutput(
            b"".join(streams), starts, self.cdf, self.max_tensors_key, self.max_tensors_value,
            self.num_heads, self.head_size, self.channel_means, self.channel_classes,
            self.symbol_ranges, self.key_bins, self.value_bins,
            block_tokens=torch.tensor([c.ntokens for c in self.data_chunks]), coder=self.coder,
            anchor_refinements=self.anchor_refinements, symbol_checksum=self.symbol_checksum)

    def to_bytes(self) -> bytes:
        return self.to_flat().to_bytes()

    @staticmethod
    def from_bytes(bs: bytes | bytearray | memoryview) -> CacheGenGPUEncoderOutput:
        return CacheGenEncoderOutput.from_bytes(bs).to_gpu_output()


@dataclass
class CacheGenEncoderOutput:
    """All token blocks in one `bytestream`; block b's substream s (s = kv * nlayers + layer)
    is ``bytestream[start_indices[b, s]:start_indices[b, s + 1]]``."""

    bytestream: bytes | memoryview  # a view of the bytes parsed: `from_bytes(view=True)`
    start_indices: torch.Tensor
    cdf: torch.Tensor
    max_tensors_key: torch.Tensor
    max_tensors_value: torch.Tensor
    num_heads: int
    head_size: int
    channel_means: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    channel_classes: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    symbol_ranges: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    key_bins: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    value_bins: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    block_tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    coder: int = fmt.CODER_RANS
    anchor_refinements: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    symbol_checksum: int = 0

    def to_gpu_output(self) -> CacheGenGPUEncoderOutput:
        data = torch.frombuffer(bytearray(self.bytestream), dtype=torch.uint8) \
            if self.bytestream else torch.empty(0, dtype=torch.uint8)
        chunks = []
        for b, ntok in enumerate(self.block_tokens.tolist()):
            starts = self.start_indices[b]
            chunks.append(CacheGenGPUBytestream(data[int(starts[0]):int(starts[-1])],
                                                starts.diff(), int(ntok)))
        return CacheGenGPUEncoderOutput(
            chunks, self.cdf, self.max_tensors_key, self.max_tensors_value, self.num_heads,
            self.head_size, self.channel_means, self.channel_classes, self.symbol_ranges,
            self.key_bins, self.value_bins, self.coder, self.anchor_refinements, self.symbol_checksum)

    def to_bytes(self) -> bytes:
        return fmt.pack(self)

    def to_parts(self) -> list[bytes | memoryview]:
        """`to_bytes` as [the stream's header and tables, the substreams] (not joined)."""
        return fmt.pack_parts(self)

    @staticmethod
    def from_bytes(bs: bytes | bytearray | memoryview, view: bool = False) -> CacheGenEncoderOutput:
        """`view`: the coded bytes stay in `bs` (decode before changing it) instead of a copy."""
        return CacheGenEncoderOutput(**fmt.unpack(bs, view))
