"""CacheGen decoder: encoded token blocks -> KV, in one fused pass (entropy decode + dequantize).

`decode_stream(encoded, dtype)` rebuilds the symbol groups from the stream's classes and frequency
tables (`StreamTables`), then the kernels (`kernels`: native, or the numpy reference) decode every
(token block, pair) substream and write ``q * step + mean`` straight into the output dtype, into a
given buffer if wanted. Streams written by the GPU coder decode on the CUDA device (`gpu`).
Anything inconsistent raises `CorruptBlobError`.

`do_dequantize` / `quant` invert the seed's max-scaled quantizers (`torch_quant_vectorized` /
`torch_quant` in `encoder`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from lmcache.cachegen import format as fmt
from lmcache.cachegen import gpu, rans
from lmcache.cachegen import quant as cgq
from lmcache.cachegen.encoded import CacheGenEncoderOutput, CacheGenGPUBytestream, CacheGenGPUEncoderOutput
from lmcache.cachegen.kernels import Kernels, kernels
from lmcache.cachegen.layout import CodeLayout
from lmcache.storage_backend.serde.serde import CorruptBlobError


def do_dequantize(t: torch.Tensor, bins: torch.Tensor, maxtensors: torch.Tensor) -> torch.Tensor:
    """Invert `torch_quant_vectorized`: t [nlayers, ntokens, nchannels], bins [nlayers],
    maxtensors [nlayers, ntokens, 1] -> float32 [nlayers, ntokens, nchannels]."""
    half = (bins.to(t.device) // 2).float()[:, None, None]
    return t.float() / half * maxtensors


def quant(bins: int, xq: torch.Tensor, max1: float | torch.Tensor) -> torch.Tensor:
    """Invert `torch_quant`: integral xq -> float32 values."""
    return xq.float() / (bins // 2) * max1


@dataclass
class StreamTables:
    """What the entropy decoder needs (the decoder-side "cdf"): the symbol layout, frequency
    tables, means float32 [2L, C], steps float32 [2L, T] and anchor refinements float32
    [B, 2L, C] of a rANS-coded stream."""

    layout: CodeLayout
    freq: np.ndarray
    means: np.ndarray
    steps: np.ndarray
    refine: np.ndarray

    @staticmethod
    def of(encoded: CacheGenEncoderOutput | CacheGenGPUEncoderOutput,
           coder: Kernels | None = None) -> StreamTables:
        nlayers, ntok = encoded.max_tensors_key.shape
        classes = encoded.channel_classes.reshape(2 * nlayers, -1).numpy()
        ranges = encoded.symbol_ranges.numpy()
        block_tokens = encoded.block_tokens if isinstance(encoded, CacheGenEncoderOutput) else \
            torch.tensor([c.ntokens for c in encoded.data_chunks])
        starts = np.concatenate([[0], np.cumsum(block_tokens.numpy())])
        try:
            layout = (coder or kernels()).layout(classes, ranges[:, 0], ranges[:, 1], starts)
        except ValueError as e:
            raise CorruptBlobError(f"cachegen symbol groups: {e}") from e
        freq = np.ascontiguousarray(encoded.cdf.numpy(), np.uint32)
        rans.check_tables(freq, layout)
        exps = torch.stack([encoded.max_tensors_key, encoded.max_tensors_value])
        means = encoded.channel_means.reshape(2 * nlayers, -1).float().numpy()
        refine = encoded.anchor_refinements.numpy()
        if refine.shape != (layout.num_blocks, *means.shape):
            raise CorruptBlobError(f"anchor refinements of shape {refine.shape}, expected "
                                   f"{(layout.num_blocks, *means.shape)}")
        return StreamTables(layout, freq, means, cgq.steps(exps.reshape(2 * nlayers, ntok).numpy()),
                            cgq.refinement_values(refine))


def _decode(tables: StreamTables, payload: bytes | memoryview, lengths: np.ndarray,
            dtype: torch.dtype, coder: Kernels | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """All substreams of `tables.layout` -> [2L, T, C] of `dtype` (CPU), into `out` if given."""
    if len(lengths) != tables.layout.num_blocks * tables.layout.num_pairs or \
            int(np.sum(lengths)) != len(payload):
        raise CorruptBlobError("cachegen substream lengths do not match the payload")
    values = (coder or kernels()).decode(payload, lengths, tables.layout, tables.freq, tables.means,
                                         tables.steps, tables.refine, tables.steps.shape[1], dtype, out)
    return values if values.dtype == dtype else values.to(dtype)


def decode_chunk(cdf: StreamTables, data_chunk: CacheGenGPUBytestream,
                 target_buffer: torch.Tensor, t0: int = 0) -> None:
    """Decode one token block (tokens t0 .. t0 + ntokens of the stream) into
    target_buffer [2 * nlayers, ntokens, nchannels] (any float dtype)."""
    ntok = data_chunk.ntokens
    (block,) = np.flatnonzero(cdf.layout.block_starts[:-1] == t0)
    single = StreamTables(dataclasses.replace(cdf.layout, block_starts=np.array([0, ntok])),
                          cdf.freq, cdf.means, np.ascontiguousarray(cdf.steps[:, t0:t0 + ntok]),
                          cdf.refine[block:block + 1])
    data = data_chunk.bytestream.cpu().numpy()
    target_buffer.copy_(_decode(single, data.tobytes(), data_chunk.bytestream_lengths.numpy(),
                                target_buffer.dtype, None))


def decode_function_gpu(cdf: StreamTables, data_chunks: list[CacheGenGPUBytestream],
                        layers_in_key: int, chunk_size: int, output: torch.Tensor) -> None:
    """Decode every token block into output [2 * layers_in_key, ntokens, nchannels] (block b
    covers the tokens after blocks 0..b-1; each has at most `chunk_size` tokens)."""
    if output.shape[0] != 2 * layers_in_key:
        raise ValueError(f"output has {output.shape[0]} pairs, expected {2 * layers_in_key}")
    t0 = 0
    for chunk in data_chunks:
        if chunk.ntokens > chunk_size:
            raise CorruptBlobError(f"token block of {chunk.ntokens} tokens > chunk_size {chunk_size}")
        decode_chunk(cdf, chunk, output[:, t0:t0 + chunk.ntokens], t0)
        t0 += chunk.ntokens


def decode_stream(encoded: CacheGenEncoderOutput, dtype: torch.dtype, coder: Kernels | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """A whole stream -> KV [2, nlayers, ntokens, nchannels] of `dtype` (CPU for rANS streams,
    the CUDA device for nvCOMP ones), written into `out` if given. `coder`: the CPU kernels
    (default: native if available)."""
    if encoded.coder == fmt.CODER_NVCOMP:
        values = gpu.decode(encoded, dtype)
        return values if out is None else out.copy_(values)
    nlayers, ntok = encoded.max_tensors_key.shape
    tables = StreamTables.of(encoded, coder)
    starts = encoded.start_indices.long()
    if int(starts[0, 0]) != 0 or (len(starts) > 1 and bool((starts[1:, 0] != starts[:-1, -1]).any())):
        raise CorruptBlobError("cachegen token blocks are not contiguous in the payload")
    lengths = starts.diff(dim=1).reshape(-1).numpy()
    values = _decode(tables, encoded.bytestream, lengths, dtype, coder, out)
    return values.view(2, nlayers, ntok, -1)


def decode_kv(encoded: CacheGenGPUEncoderOutput, dtype: torch.dtype,
              device: torch.device | str = "cpu", coder: Kernels | None = None) -> torch.Tensor:
    """A whole encoder output -> KV [2, nlayers, ntokens, nchannels] of `dtype` on `device`."""
    return decode_stream(encoded.to_flat(), dtype, coder).to(device)
