"""CacheGen decoder: encoded token blocks -> KV, in one fused pass (entropy decode + dequantize).

`decode_stream(encoded, dtype)` rebuilds the symbol groups from the stream's classes and frequency
tables (`StreamTables`), then the kernels (`kernels`: native, or the numpy reference) decode every
(token block, pair) substream and write ``q * step + mean`` straight into the output dtype, into a
given buffer if wanted. Streams written by the GPU coder decode on the CUDA device (`gpu`).
Anything inconsistent raises `CorruptBlobError`.

Token blocks decode independently: `StreamTables.block` gives one block's tables, and
`decode_substreams` decodes the substreams of any tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from lmcache.cachegen import format as fmt
from lmcache.cachegen import gpu, rans
from lmcache.cachegen import quant as cgq
from lmcache.cachegen.encoded import CacheGenEncoderOutput, CacheGenGPUEncoderOutput
from lmcache.cachegen.kernels import Kernels, kernels
from lmcache.cachegen.layout import CodeLayout
from lmcache.storage_backend.serde.serde import CorruptBlobError


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

    def block(self, t0: int, ntokens: int) -> StreamTables:
        """The tables of the token block starting at token t0 alone (`ntokens` tokens)."""
        (b,) = np.flatnonzero(self.layout.block_starts[:-1] == t0)
        return StreamTables(dataclasses.replace(self.layout, block_starts=np.array([0, ntokens])),
                            self.freq, self.means, np.ascontiguousarray(self.steps[:, t0:t0 + ntokens]),
                            self.refine[b:b + 1])


def decode_substreams(tables: StreamTables, payload: bytes | memoryview, lengths: np.ndarray,
                      dtype: torch.dtype, coder: Kernels | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """All substreams of `tables.layout` (byte lengths [B * 2L], one after another in `payload`)
    -> [2L, T, C] of `dtype` (CPU), into `out` if given (any shape of 2L * T * C elements;
    ValueError otherwise)."""
    _check_out(out, tables.layout.num_pairs * tables.steps.shape[1] * tables.means.shape[1])
    if len(lengths) != tables.layout.num_blocks * tables.layout.num_pairs or \
            int(np.sum(lengths)) != len(payload):
        raise CorruptBlobError("cachegen substream lengths do not match the payload")
    values = (coder or kernels()).decode(payload, lengths, tables.layout, tables.freq, tables.means,
                                         tables.steps, tables.refine, tables.steps.shape[1], dtype, out)
    return values if values.dtype == dtype else values.to(dtype)


def decode_stream(encoded: CacheGenEncoderOutput, dtype: torch.dtype, coder: Kernels | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """A whole stream -> KV [2, nlayers, ntokens, nchannels] of `dtype` (CPU for rANS streams,
    the CUDA device for nvCOMP ones), written into `out` if given (2 * nlayers * ntokens *
    nchannels elements; ValueError otherwise). `coder`: the CPU kernels (default: native if
    available)."""
    if encoded.coder == fmt.CODER_NVCOMP:
        _check_out(out, encoded.channel_means.numel() * encoded.max_tensors_key.shape[1])
        values = gpu.decode(encoded, dtype)
        return values if out is None else out.copy_(values.reshape(out.shape))
    nlayers, ntok = encoded.max_tensors_key.shape
    tables = StreamTables.of(encoded, coder)
    starts = encoded.start_indices.long()
    if int(starts[0, 0]) != 0 or (len(starts) > 1 and bool((starts[1:, 0] != starts[:-1, -1]).any())):
        raise CorruptBlobError("cachegen token blocks are not contiguous in the payload")
    lengths = starts.diff(dim=1).reshape(-1).numpy()
    values = decode_substreams(tables, encoded.bytestream, lengths, dtype, coder, out)
    return values.view(2, nlayers, ntok, -1)


def _check_out(out: torch.Tensor | None, numel: int) -> None:
    """Raise ValueError unless `out` is None or holds exactly `numel` elements (the kernels
    write the whole stream into it)."""
    if out is not None and out.numel() != numel:
        raise ValueError(f"out has {out.numel()} elements ({tuple(out.shape)}); the stream decodes "
                         f"to {numel}")


def decode_kv(encoded: CacheGenGPUEncoderOutput, dtype: torch.dtype,
              device: torch.device | str = "cpu", coder: Kernels | None = None) -> torch.Tensor:
    """A whole encoder output -> KV [2, nlayers, ntokens, nchannels] of `dtype` on `device`."""
    return decode_stream(encoded.to_flat(), dtype, coder).to(device)
