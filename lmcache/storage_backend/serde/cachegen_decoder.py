"""CacheGen decoder: versioned stream -> symbols (constriction, CPU) -> KV (torch, any device).

`CacheGenDeserializer.from_bytes(blob)` validates the common blob header, parses the stream
(`cachegen_format`), rebuilds the symbol groups from the shipped classes and frequency tables,
decodes every (token block, pair) substream (`decode_function_gpu` / `decode_chunk`), then
dequantizes in torch: symbols are un-permuted back to channel order and mapped to
``q * step + mean`` straight into the output dtype. Any inconsistency raises `CorruptBlobError`.

`do_dequantize` / `quant` invert the seed's max-scaled quantizers (`torch_quant_vectorized` /
`torch_quant` in `cachegen_encoder`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.storage_backend.serde import blob
from lmcache.storage_backend.serde import cachegen_coder as coder
from lmcache.storage_backend.serde import cachegen_quant as cgq
from lmcache.storage_backend.serde.cachegen_basics import (
    CacheGenConfig,
    CacheGenGPUBytestream,
    CacheGenGPUEncoderOutput,
)
from lmcache.storage_backend.serde.serde import CorruptBlobError, Deserializer


def do_dequantize(t: torch.Tensor, bins: torch.Tensor, maxtensors: torch.Tensor) -> torch.Tensor:
    """Invert `torch_quant_vectorized`: t [nlayers, ntokens, nchannels], bins [nlayers],
    maxtensors [nlayers, ntokens, 1] -> float32 [nlayers, ntokens, nchannels]."""
    half = (bins.to(t.device) // 2).float()[:, None, None]
    return t.float() / half * maxtensors


def quant(bins: int, xq: torch.Tensor, max1: float | torch.Tensor) -> torch.Tensor:
    """Invert `torch_quant`: integral xq -> float32 values."""
    return xq.float() / (bins // 2) * max1


@dataclass
class SymbolModels:
    """What the entropy decoder needs (the decoder-side "cdf"): groups and their models."""

    layout: coder.SymbolLayout
    models: dict[int, object]

    @staticmethod
    def of(encoded: CacheGenGPUEncoderOutput) -> SymbolModels:
        classes = encoded.channel_classes.reshape(-1, encoded.channel_classes.shape[-1])
        ranges = encoded.symbol_ranges.numpy()
        layout = coder.SymbolLayout.from_classes(classes, ranges[:, 0], ranges[:, 1])
        if layout.num_groups != len(ranges):
            raise CorruptBlobError(f"{len(ranges)} symbol ranges for {layout.num_groups} groups")
        return SymbolModels(layout, coder.build_models(layout, encoded.cdf.numpy()))


def decode_chunk(cdf: SymbolModels, data_chunk: CacheGenGPUBytestream,
                 target_buffer: np.ndarray) -> None:
    """Decode one token block into target_buffer [2 * nlayers, nchannels, ntokens] int32 (rows
    in the layout's sorted channel order, symbols offset to [0, n) per group)."""
    npairs = len(cdf.layout.groups)
    lengths = data_chunk.bytestream_lengths.tolist()
    if len(lengths) != npairs or target_buffer.shape[2] != data_chunk.ntokens:
        raise CorruptBlobError(f"token block has {len(lengths)} substreams for {npairs} pairs")
    data = data_chunk.bytestream.cpu().numpy()
    if len(data) != sum(lengths):
        raise CorruptBlobError("token block is shorter than its substream lengths")
    words = np.frombuffer(data.tobytes(), dtype=np.uint32)  # aligned copy
    start = 0
    for g, nbytes in enumerate(lengths):
        coder.decode_substream(words[start // 4:(start + nbytes) // 4], cdf.layout.groups[g],
                               cdf.models, target_buffer[g])
        start += nbytes


def decode_function_gpu(cdf: SymbolModels, data_chunks: list[CacheGenGPUBytestream],
                        layers_in_key: int, chunk_size: int, output: np.ndarray) -> None:
    """Decode every token block into output [2 * layers_in_key, nchannels, ntokens] int32
    (block b covers the tokens after blocks 0..b-1; each has at most `chunk_size` tokens)."""
    if output.shape[0] != 2 * layers_in_key:
        raise ValueError(f"output has {output.shape[0]} pairs, expected {2 * layers_in_key}")
    t0 = 0
    for chunk in data_chunks:
        if chunk.ntokens > chunk_size:
            raise CorruptBlobError(f"token block of {chunk.ntokens} tokens > chunk_size {chunk_size}")
        decode_chunk(cdf, chunk, output[:, :, t0:t0 + chunk.ntokens])
        t0 += chunk.ntokens


def decode_kv(encoded: CacheGenGPUEncoderOutput, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """A whole encoder output -> KV [2, nlayers, ntokens, nchannels] of `dtype` on `device`."""
    exps = torch.stack([encoded.max_tensors_key, encoded.max_tensors_value])
    _, nlayers, ntok = exps.shape
    nch = encoded.channel_means.shape[-1]
    models = SymbolModels.of(encoded)
    symbols = np.empty((2 * nlayers, nch, ntok), dtype=np.int32)
    decode_function_gpu(models, encoded.data_chunks, nlayers, max(ntok, 1), symbols)
    layout = models.layout
    rows = torch.argsort(layout.perm, dim=1) + torch.arange(2 * nlayers)[:, None] * nch
    q = torch.from_numpy(symbols).view(-1, ntok).index_select(0, rows.reshape(-1)).to(device)
    q = q.float().view(2 * nlayers, nch, ntok)  # channel order again
    low = layout.group_values("low").to(device, torch.float32)[layout.group_of.to(device)]
    q.add_(low[:, :, None])
    means = encoded.channel_means.reshape(2 * nlayers, nch).to(device).float()
    cgq.dequantize_(q, means, exps.reshape(2 * nlayers, ntok).to(device))
    return cgq.to_token_major(q, nlayers, dtype)


class CacheGenDeserializer(Deserializer):
    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.chunk_size = config.chunk_size
        self.nlayers = metadata.num_layers
        self.cachegen_config = CacheGenConfig.from_model_name(metadata.model_name, self.nlayers)

    def make_key_bins(self, config: CacheGenConfig) -> torch.Tensor:
        return torch.tensor(config.key_bins(), dtype=torch.int32)

    def make_value_bins(self, config: CacheGenConfig) -> torch.Tensor:
        return torch.tensor(config.value_bins(), dtype=torch.int32)

    def get_output_buffer(self, nlayers: int, nchannels: int, ntokens: int) -> torch.Tensor:
        """An empty KV_BLOB [2, nlayers, ntokens, nchannels] of the deserializer's dtype."""
        return torch.empty(2, nlayers, ntokens, nchannels, dtype=self.dtype)

    def from_bytes(self, bs: bytes | bytearray | memoryview) -> torch.Tensor:
        """Blob -> KV_BLOB [2, L, T, C] on the CPU, in the dtype it was serialized from."""
        header = blob.unpack(bs, "cachegen")
        encoded = CacheGenGPUEncoderOutput.from_bytes(header.payload)
        shape = (2, len(encoded.key_bins), encoded.ntokens, encoded.channel_means.shape[-1])
        if tuple(header.shape) != shape:
            raise CorruptBlobError(f"blob header shape {tuple(header.shape)} != stream shape {shape}")
        return decode_kv(encoded, header.dtype)
