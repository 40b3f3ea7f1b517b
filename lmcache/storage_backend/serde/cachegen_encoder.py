"""CacheGen encoder: KV chunk -> quantized symbols -> entropy-coded, versioned stream.

Pipeline of `encode_function(kv [2, L, T, C], config, key_bins, value_bins, chunk_size)`:

1. `CacheGenEncoderImpl.quantize()` (torch, any device): per-channel means, per-token step
   exponents, integer symbols (`cachegen_quant`).
2. `CacheGenEncoderImpl.compute_cdf(is_key)`: channel classes, the sorted channel-major symbol
   layout, and one frequency table per (pair, class) group (`cachegen_coder`). The tables are
   counted on every `HIST_STRIDE`-th token (a decoder never needs more than the table itself;
   every symbol of a group's range stays codable), which costs < 0.01 bits/value.
3. Token blocks of `chunk_size` tokens are entropy-coded independently, one ANS substream per
   (block, pair), with `constriction` on the CPU (symbols move to the host as int32).

`CacheGenSerializer.to_bytes(kv)` encodes one KV_BLOB chunk ``[2, L, T, C]`` (T <= chunk_size)
as a single block and wraps the stream in the common blob header (`blob.pack_header`).

`torch_quant` / `torch_quant_vectorized` are the seed's max-scaled quantizers (one max per tensor /
per token); the codec itself uses RMS-relative steps (see `cachegen_quant` for why), and the
quality benchmark uses `torch_quant_vectorized` for its 8-bit per-token baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.storage_backend.serde import blob
from lmcache.storage_backend.serde import cachegen_coder as coder
from lmcache.storage_backend.serde import cachegen_quant as quant
from lmcache.storage_backend.serde.cachegen_basics import (
    CacheGenConfig,
    CacheGenGPUBytestream,
    CacheGenGPUEncoderOutput,
)
from lmcache.storage_backend.serde.cachegen_format import MAX_ALPHABET
from lmcache.storage_backend.serde.serde import Serializer

HIST_STRIDE = 4
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def torch_quant(bins: int, qA: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a whole float tensor to `bins` symmetric levels scaled by its max |value|.

    Returns (xq, max1): xq float32 with integral values in [-(bins // 2), bins // 2] (same shape
    as qA) and max1, the 0-d max |qA|. `do_dequantize` / `quant` invert it."""
    half = bins // 2
    max1 = qA.abs().amax().float().clamp_min(1e-30)
    return torch.round(qA.float() / max1 * half), max1


def torch_quant_vectorized(bins: torch.Tensor, input_groups: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token max scaling: input_groups [nlayers, ntokens, nchannels], bins [nlayers].

    Returns (quantized [nlayers, ntokens, nchannels] float32 integral values in
    [-(bins // 2), bins // 2], maxes [nlayers, ntokens, 1] float32)."""
    half = (bins.to(input_groups.device) // 2).float()[:, None, None]
    maxes = input_groups.abs().amax(dim=2, keepdim=True).float().clamp_min(1e-30)
    return torch.round(input_groups.float() / maxes * half), maxes


def concat_max(max1: dict[int, torch.Tensor]) -> torch.Tensor:
    """{layer: [ntokens] or [ntokens, 1]} per-token scales -> [nlayers, ntokens] in layer order."""
    return torch.stack([max1[k].reshape(-1) for k in sorted(max1)])


def collect_bytes(output_buffer: torch.Tensor, output_lengths: torch.Tensor) -> torch.Tensor:
    """Rows of a padded byte buffer [n, capacity] with used lengths [n] -> one uint8 tensor."""
    return torch.cat([output_buffer[i, :int(n)] for i, n in enumerate(output_lengths.tolist())])


@dataclass
class SymbolTables:
    """`CacheGenEncoderImpl.compute_cdf`'s result for a set of (K/V, layer) pairs."""

    layout: coder.SymbolLayout
    classes: torch.Tensor  # [pairs, C] uint8
    symbols: np.ndarray  # [pairs, C, T] int32, class-sorted rows, offset to [0, n) per group
    freqs: np.ndarray  # concatenated frequency tables (int32, < 2**16)


class CacheGenEncoderImpl:
    """One encode call's state. kwargs: fp_k, fp_v ([L, T, C] float, any device),
    key_bins, value_bins ([L] ints)."""

    def __init__(self, **kwargs: torch.Tensor) -> None:
        self.fp_k = kwargs["fp_k"]
        self.fp_v = kwargs["fp_v"]
        self.key_bins = torch.as_tensor(kwargs["key_bins"]).reshape(-1)
        self.value_bins = torch.as_tensor(kwargs["value_bins"]).reshape(-1)
        self.nlayers = self.fp_k.shape[0]
        self.means = torch.empty(0)
        self.exps = torch.empty(0)
        self.q = torch.empty(0)
        self.tables: dict[bool | None, SymbolTables] = {}

    def _channel_major(self) -> torch.Tensor:
        return quant.to_channel_major(torch.stack([self.fp_k, self.fp_v]))

    def quantize(self) -> None:
        """Sets means [2L, C], exps [2L, T] and q [2L, C, T] (integral float32, channel-major)."""
        x = self._channel_major()
        bins = torch.cat([self.key_bins, self.value_bins])
        self.means = quant.channel_means(x)
        self.exps = quant.step_exponents(x, bins)
        self.q = quant.quantize_(x, self.means, self.exps)
        if max(-float(self.q.amin()), float(self.q.amax())) > quant.QMAX:
            x = self._channel_major()
            self.exps = quant.bound_exponents(x, self.means, self.exps)
            self.q = quant.quantize_(x, self.means, self.exps)

    def compute_cdf(self, is_key: bool | None = None) -> SymbolTables:
        """Channel classes, symbol groups with their ranges and frequency tables, and the
        class-sorted symbols of the K pairs (is_key=True), the V pairs (False) or all 2L pairs
        (None, K first: what the stream holds). Consumes `self.q` of those pairs."""
        if is_key is None:
            q = self.q
        else:
            q = self.q[: self.nlayers] if is_key else self.q[self.nlayers:]
        npairs, nch, ntok = q.shape
        classes = coder.channel_classes(q)
        layout = coder.SymbolLayout.from_classes(classes)
        group_of = layout.group_of.to(q.device).reshape(-1)
        ngroups = layout.num_groups
        low = torch.full((ngroups,), float("inf"), device=q.device).scatter_reduce_(
            0, group_of, q.amin(dim=2).reshape(-1), "amin")
        high = torch.full((ngroups,), float("-inf"), device=q.device).scatter_reduce_(
            0, group_of, q.amax(dim=2).reshape(-1), "amax")
        size = (high - low + 1).long().cpu().numpy()
        if int(size.max()) > MAX_ALPHABET:
            raise ValueError("CacheGen symbol range exceeds the format's alphabet limit")
        layout = layout.with_ranges(low.long().cpu().numpy(), size)
        q.sub_(low[group_of].reshape(npairs, nch, 1))  # symbols in [0, n) per group
        qi = q.to(torch.int32)
        offset = layout.group_values("freq_start").to(q.device, torch.int32)[group_of]
        sample = qi[:, :, ::HIST_STRIDE] + offset.reshape(npairs, nch, 1)
        counts = torch.bincount(sample.reshape(-1), minlength=layout.total_size()).cpu().numpy()
        rows = layout.perm.to(q.device) + torch.arange(npairs, device=q.device)[:, None] * nch
        symbols = qi.view(-1, ntok).index_select(0, rows.reshape(-1))
        tables = SymbolTables(layout, classes.cpu(), symbols.view(npairs, nch, ntok).cpu().numpy(),
                              _to_u16(counts.astype(np.int64), layout))
        self.tables[is_key] = tables
        return tables


def _to_u16(counts: np.ndarray, layout: coder.SymbolLayout) -> np.ndarray:
    """Scale each group's counts so that its largest fits in 16 bits (nonzero stays nonzero)."""
    starts = layout.group_values("freq_start").numpy()
    sizes = layout.group_values("size").numpy()
    peak = np.repeat(np.maximum.reduceat(counts, starts), sizes)
    scaled = np.where(peak > 65535, -(-counts * 65535 // np.maximum(peak, 1)), counts)
    return scaled.astype(np.int32)


def encode_function(kv: torch.Tensor, config: CacheGenConfig, key_bins: torch.Tensor,
                    value_bins: torch.Tensor, chunk_size: int) -> CacheGenGPUEncoderOutput:
    """Encode kv [2, L, T, C] (any float dtype and device) in independent token blocks of
    `chunk_size` tokens. `key_bins` / `value_bins`: [L] bins (from `config`). The output says
    num_heads=1, head_size=C; callers that know the head split overwrite both."""
    if kv.dim() != 4 or kv.shape[0] != 2 or min(kv.shape) < 1:
        raise ValueError(f"CacheGen encodes KV of shape [2, L, T, C]; got {tuple(kv.shape)}")
    if kv.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"CacheGen encodes floating-point KV; got {kv.dtype}")
    if kv.shape[1] != config.nlayers or len(key_bins) != config.nlayers:
        raise ValueError(f"KV has {kv.shape[1]} layers, CacheGen config has {config.nlayers}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    impl = CacheGenEncoderImpl(fp_k=kv[0], fp_v=kv[1], key_bins=key_bins, value_bins=value_bins)
    impl.quantize()
    tables = impl.compute_cdf()
    layout, symbols = tables.layout, tables.symbols  # symbols: [2L, C, T]
    models = coder.build_models(layout, tables.freqs)
    ntok = kv.shape[2]
    blocks = []
    for t0 in range(0, ntok, chunk_size):
        t1 = min(ntok, t0 + chunk_size)
        streams = [coder.encode_substream(symbols[g, :, t0:t1], layout.groups[g], models)
                   for g in range(len(layout.groups))]
        lengths = torch.tensor([s.nbytes for s in streams], dtype=torch.int64)
        data = np.concatenate(streams).view(np.uint8) if lengths.sum() else np.zeros(0, np.uint8)
        blocks.append(CacheGenGPUBytestream(torch.from_numpy(data), lengths, t1 - t0))
    exps = impl.exps.cpu().to(torch.int16).reshape(2, config.nlayers, ntok)
    ranges = torch.stack([layout.group_values("low"), layout.group_values("size")], 1)
    return CacheGenGPUEncoderOutput(
        blocks, torch.from_numpy(tables.freqs), exps[0], exps[1], 1, kv.shape[3],
        channel_means=impl.means.cpu().to(torch.bfloat16).reshape(2, config.nlayers, -1),
        channel_classes=tables.classes.reshape(2, config.nlayers, -1),
        symbol_ranges=ranges.to(torch.int32),
        key_bins=torch.as_tensor(key_bins, dtype=torch.int32),
        value_bins=torch.as_tensor(value_bins, dtype=torch.int32),
    )


class CacheGenSerializer(Serializer):
    """Bins come from `cachegen_config` if given, else `CacheGenConfig.from_model_name` (the
    model's fitted table, or the layer-count default)."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 cachegen_config: CacheGenConfig | None = None) -> None:
        self.chunk_size = config.chunk_size
        self.num_heads, self.head_size = metadata.kv_shape[3], metadata.kv_shape[4]
        self.cachegen_config = cachegen_config or CacheGenConfig.from_model_name(
            metadata.model_name, metadata.num_layers)
        self.key_bins = self.make_key_bins(self.cachegen_config)
        self.value_bins = self.make_value_bins(self.cachegen_config)

    def make_key_bins(self, config: CacheGenConfig) -> torch.Tensor:
        return torch.tensor(config.key_bins(), dtype=torch.int32)

    def make_value_bins(self, config: CacheGenConfig) -> torch.Tensor:
        return torch.tensor(config.value_bins(), dtype=torch.int32)

    def to_bytes(self, tensor: torch.Tensor) -> bytes:
        """KV_BLOB chunk [2, L, T, num_heads * head_size] -> blob (header + cachegen stream)."""
        if tensor.dim() != 4 or tensor.shape[3] != self.num_heads * self.head_size:
            raise ValueError(f"CacheGen serializes KV_BLOB [2, L, T, {self.num_heads * self.head_size}]"
                             f"; got {tuple(tensor.shape)}")
        out = encode_function(tensor, self.cachegen_config, self.key_bins, self.value_bins,
                              max(self.chunk_size, tensor.shape[2]))
        out.num_heads, out.head_size = self.num_heads, self.head_size
        payload = out.to_bytes()
        return blob.pack_header("cachegen", tensor.shape, tensor.dtype, payload) + payload
