"""CacheGen's configuration (bins per layer) and its encoder outputs (seed 003 names).

`QuantizationSpec(start_layer, end_layer, bins)` gives layers ``[start_layer, end_layer)`` (end
exclusive) a number of quantization bins; `CacheGenConfig(nlayers, kspecs, vspecs)` holds one
spec list for keys and one for values, which must cover every layer exactly once.

What `bins` means here: a token's vector x_t (one layer, K or V, all ``hidden`` channels) is
quantized with the uniform step ``8 * rms(x_t) / bins`` (see `cachegen_quant`), i.e. `bins` steps
span +-4 RMS of the token; values further out are still coded exactly (no clipping), so the error
of every value is at most half a step. More bins = finer steps = more bits.

`CacheGenConfig.from_model_name` returns the table fitted for a known model family
(`cachegen_tables`), else `default_for_layers`: the same bins on every layer, keys more than
values (on the model measured, keys are the more sensitive and no depth rule holds).

The encoder output classes keep the seed's names and fields, with these meanings:

- `cdf`: the frequency tables of all symbol groups, concatenated (int32; each group's sums to
  2**12, `cachegen_rans`); a group is (K/V, layer, channel class) (`cachegen_layout`);
  `symbol_ranges[g] = (lowest symbol, alphabet size)`.
- `max_tensors_key` / `max_tensors_value`: the per-token scales, as step exponents
  ``e`` (int16, ``step = 2 ** (e / 8)``), shape ``[nlayers, ntokens]``.
- extra fields: `channel_means` (bf16 ``[2, nlayers, hidden]``), `channel_classes` (uint8
  ``[2, nlayers, hidden]``), `symbol_ranges` (int32 ``[ngroups, 2]``), `key_bins` / `value_bins`
  (the bins used, int32 ``[nlayers]``), `anchor_refinements` (uint8 ``[nblocks, 2 * nlayers,
  hidden]``: the 3 extra bits of each block's first token, `cachegen_quant`), `coder` (which
  entropy coder wrote the data:
  `cachegen_format.CODER_RANS` or `CODER_NVCOMP`; nvCOMP streams have no classes or tables).

`CacheGenGPUEncoderOutput` keeps the entropy-coded data as one `CacheGenGPUBytestream` per token
block (uint8 tensors; blocks decode independently); `CacheGenEncoderOutput` is the same content
with all blocks in one `bytes` object and `start_indices` (byte offsets) — the form written to
the wire. Both `to_bytes` / `from_bytes` use the versioned format of `cachegen_format`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmcache.cachegen import format as fmt
from lmcache.cachegen.tables import known_table

MAX_BINS = 1024
DEFAULT_KEY_BINS = 36  # the default for models without a fitted table (`default_for_layers`)
DEFAULT_VALUE_BINS = 14


@dataclass(frozen=True)
class QuantizationSpec:
    """Layers ``[start_layer, end_layer)`` use `bins` quantization bins."""

    start_layer: int
    end_layer: int
    bins: int

    def __post_init__(self) -> None:
        if self.start_layer < 0 or self.end_layer <= self.start_layer:
            raise ValueError(f"QuantizationSpec layers [{self.start_layer}, {self.end_layer}) are "
                             "empty or negative; need 0 <= start_layer < end_layer")
        if not 2 <= self.bins <= MAX_BINS:
            raise ValueError(f"QuantizationSpec bins={self.bins} must be in [2, {MAX_BINS}]")


def _check_cover(name: str, specs: list[QuantizationSpec], nlayers: int) -> None:
    if not specs:
        raise ValueError(f"{name} is empty; it must cover layers [0, {nlayers})")
    covered = [0] * nlayers
    for spec in specs:
        if spec.end_layer > nlayers:
            raise ValueError(f"{name}: {spec} reaches past nlayers={nlayers}")
        for layer in range(spec.start_layer, spec.end_layer):
            covered[layer] += 1
    twice = [i for i, c in enumerate(covered) if c > 1]
    missing = [i for i, c in enumerate(covered) if c == 0]
    if twice:
        raise ValueError(f"{name}: layers {twice} are covered by more than one spec")
    if missing:
        raise ValueError(f"{name}: layers {missing} are not covered by any spec")


def specs_from_bins(bins: list[int]) -> list[QuantizationSpec]:
    """Runs of equal per-layer bins -> the shortest spec list."""
    specs: list[QuantizationSpec] = []
    start = 0
    for layer in range(1, len(bins) + 1):
        if layer == len(bins) or bins[layer] != bins[start]:
            specs.append(QuantizationSpec(start, layer, int(bins[start])))
            start = layer
    return specs


def _bins_per_layer(specs: list[QuantizationSpec], nlayers: int) -> list[int]:
    out = [0] * nlayers
    for spec in specs:
        for layer in range(spec.start_layer, spec.end_layer):
            out[layer] = spec.bins
    return out


@dataclass
class CacheGenConfig:
    nlayers: int
    kspecs: list[QuantizationSpec]
    vspecs: list[QuantizationSpec]

    def __post_init__(self) -> None:
        if self.nlayers < 1:
            raise ValueError(f"CacheGenConfig nlayers={self.nlayers} must be >= 1")
        _check_cover("kspecs", self.kspecs, self.nlayers)
        _check_cover("vspecs", self.vspecs, self.nlayers)

    def key_bins(self) -> list[int]:
        return _bins_per_layer(self.kspecs, self.nlayers)

    def value_bins(self) -> list[int]:
        return _bins_per_layer(self.vspecs, self.nlayers)

    def scaled(self, factor: float) -> CacheGenConfig:
        """The same allocation with every layer's bins multiplied by `factor` (clamped)."""
        def scale(bins: list[int]) -> list[QuantizationSpec]:
            return specs_from_bins([min(MAX_BINS, max(2, round(b * factor))) for b in bins])
        return CacheGenConfig(self.nlayers, scale(self.key_bins()), scale(self.value_bins()))

    @staticmethod
    def uniform(nlayers: int, key_bins: int, value_bins: int) -> CacheGenConfig:
        return CacheGenConfig(nlayers, [QuantizationSpec(0, nlayers, key_bins)],
                              [QuantizationSpec(0, nlayers, value_bins)])

    @staticmethod
    def default_for_layers(nlayers: int) -> CacheGenConfig:
        """Any model without a fitted table: K bins 36 and V bins 14 on every layer (the
        cheapest such flat table that keeps SmolLM2's KL <= 0.0075 on every fitting text, the
        target of the fitted tables: `benchmarks/cachegen_calibrate.py --layer-count-default`;
        the one calibrated model does not support giving early layers more bins)."""
        if nlayers < 1:
            raise ValueError(f"nlayers={nlayers} must be >= 1")
        return CacheGenConfig.uniform(nlayers, DEFAULT_KEY_BINS, DEFAULT_VALUE_BINS)

    @staticmethod
    def from_model_name(model_name: str, nlayers: int | None = None) -> CacheGenConfig:
        """The fitted table of a known model family (when its layer count matches `nlayers`, if
        given), else `default_for_layers(nlayers)`; an unknown model needs `nlayers`."""
        table = known_table(model_name)
        if table is not None and (nlayers is None or len(table[0]) == nlayers):
            return CacheGenConfig(len(table[0]), specs_from_bins(list(table[0])),
                                  specs_from_bins(list(table[1])))
        if nlayers is None:
            raise ValueError(f"no CacheGen table for model {model_name!r}; pass nlayers to get "
                             "the default allocation")
        return CacheGenConfig.default_for_layers(nlayers)


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

    @property
    def ntokens(self) -> int:
        return sum(c.ntokens for c in self.data_chunks)

    def debug_print_device(self) -> None:
        print({name: getattr(self, name).device for name in fmt.TENSOR_FIELDS})

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
            anchor_refinements=self.anchor_refinements)

    def to_bytes(self) -> bytes:
        return self.to_flat().to_bytes()

    @staticmethod
    def from_bytes(bs: bytes | bytearray | memoryview) -> CacheGenGPUEncoderOutput:
        return CacheGenEncoderOutput.from_bytes(bs).to_gpu_output()


@dataclass
class CacheGenEncoderOutput:
    """All token blocks in one `bytestream`; block b's substream s (s = kv * nlayers + layer)
    is ``bytestream[start_indices[b, s]:start_indices[b, s + 1]]``."""

    bytestream: bytes
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
            self.key_bins, self.value_bins, self.coder, self.anchor_refinements)

    def to_bytes(self) -> bytes:
        return fmt.pack(self)

    def to_parts(self) -> list[bytes]:
        """`to_bytes` as [the stream's header and tables, the substreams] (not joined)."""
        return fmt.pack_parts(self)

    @staticmethod
    def from_bytes(bs: bytes | bytearray | memoryview) -> CacheGenEncoderOutput:
        return CacheGenEncoderOutput(**fmt.unpack(bs))
