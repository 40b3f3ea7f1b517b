"""Seed 003's CacheGen helpers that the codec itself never calls (`lmcache.cachegen` is the codec).

The seed paths `lmcache.storage_backend.serde.cachegen_encoder` / `cachegen_decoder` /
`cachegen_basics` re-export these names from here.

- max-scaled quantizers: `torch_quant` (one max per tensor) and `torch_quant_vectorized` (one max
  per token), inverted by `quant` and `do_dequantize`. The codec uses RMS-relative steps instead
  (`lmcache.cachegen.quant` says why); the quality benchmark uses `torch_quant_vectorized` for its
  8-bit per-token baseline.
- `concat_max`, `collect_bytes`: the seed's small tensor helpers.
- `encode_function`: KV -> `CacheGenGPUEncoderOutput` in token blocks, on the CUDA device with
  nvCOMP where present, else with the CPU coder (`lmcache.cachegen.encoder.encode_stream`).
- `decode_chunk` / `decode_function_gpu`: one token block / every block of such an output into a
  buffer (`lmcache.cachegen.decoder.decode_kv` decodes a whole output).
- `debug_print_device`: the seed's method `CacheGenGPUEncoderOutput.debug_print_device()`,
  attached to the class when this module is imported (so the codec's class stays free of it).
"""

from __future__ import annotations

import torch

from lmcache.cachegen import gpu
from lmcache.cachegen.config import CacheGenConfig
from lmcache.cachegen.decoder import StreamTables, decode_substreams
from lmcache.cachegen.encoded import CacheGenGPUBytestream, CacheGenGPUEncoderOutput
from lmcache.cachegen.encoder import check_kv, encode_stream
from lmcache.storage_backend.serde.serde import CorruptBlobError

_TENSOR_FIELDS = ("cdf", "max_tensors_key", "max_tensors_value", "channel_means", "channel_classes",
                  "symbol_ranges")


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


def quant(bins: int, xq: torch.Tensor, max1: float | torch.Tensor) -> torch.Tensor:
    """Invert `torch_quant`: integral xq -> float32 values."""
    return xq.float() / (bins // 2) * max1


def do_dequantize(t: torch.Tensor, bins: torch.Tensor, maxtensors: torch.Tensor) -> torch.Tensor:
    """Invert `torch_quant_vectorized`: t [nlayers, ntokens, nchannels], bins [nlayers],
    maxtensors [nlayers, ntokens, 1] -> float32 [nlayers, ntokens, nchannels]."""
    half = (bins.to(t.device) // 2).float()[:, None, None]
    return t.float() / half * maxtensors


def concat_max(max1: dict[int, torch.Tensor]) -> torch.Tensor:
    """{layer: [ntokens] or [ntokens, 1]} per-token scales -> [nlayers, ntokens] in layer order."""
    return torch.stack([max1[k].reshape(-1) for k in sorted(max1)])


def collect_bytes(output_buffer: torch.Tensor, output_lengths: torch.Tensor) -> torch.Tensor:
    """Rows of a padded byte buffer [n, capacity] with used lengths [n] -> one uint8 tensor.
    ValueError unless there is one length per row, each in [0, capacity]."""
    rows, capacity = output_buffer.shape
    lengths = [int(n) for n in output_lengths.reshape(-1).tolist()]
    if len(lengths) != rows or not all(0 <= n <= capacity for n in lengths):
        raise ValueError(f"output_lengths {lengths} do not fit a buffer of {rows} rows of {capacity} bytes")
    return torch.cat([output_buffer[i, :n] for i, n in enumerate(lengths)])


def encode_function(kv: torch.Tensor, config: CacheGenConfig, key_bins: torch.Tensor,
                    value_bins: torch.Tensor, chunk_size: int) -> CacheGenGPUEncoderOutput:
    """Encode kv [2, L, T, C] (any float dtype and device) in independent token blocks of
    `chunk_size` tokens: on the CUDA device with nvCOMP where CUDA and nvCOMP are present
    (`lmcache.cachegen.gpu`; one block), else with the CPU rANS coder. `key_bins` / `value_bins`:
    [L] bins (from `config`). The output says num_heads=1, head_size=C; callers that know the
    head split overwrite both."""
    check_kv(kv, config.nlayers, chunk_size)
    if len(key_bins) != config.nlayers:
        raise ValueError(f"{len(key_bins)} key bins for {config.nlayers} layers")
    if gpu.available():
        return gpu.encode(kv, key_bins, value_bins)
    return encode_stream(kv, key_bins, value_bins, chunk_size).to_gpu_output()


def decode_chunk(cdf: StreamTables, data_chunk: CacheGenGPUBytestream,
                 target_buffer: torch.Tensor, t0: int = 0) -> None:
    """Decode one token block (tokens t0 .. t0 + ntokens of the stream) into
    target_buffer [2 * nlayers, ntokens, nchannels] (any float dtype)."""
    data = data_chunk.bytestream.cpu().numpy()
    target_buffer.copy_(decode_substreams(cdf.block(t0, data_chunk.ntokens), data.tobytes(),
                                          data_chunk.bytestream_lengths.numpy(), target_buffer.dtype))


def decode_function_gpu(cdf: StreamTables, data_chunks: list[CacheGenGPUBytestream],
                        layers_in_key: int, chunk_size: int, output: torch.Tensor) -> None:
    """Decode every token block into output [2 * layers_in_key, ntokens, nchannels] (block b
    covers the tokens after blocks 0..b-1; each has at most `chunk_size` tokens). ValueError, with
    nothing written, for an output of other pairs or too few tokens."""
    if output.shape[0] != 2 * layers_in_key:
        raise ValueError(f"output has {output.shape[0]} pairs, expected {2 * layers_in_key}")
    ntokens = sum(chunk.ntokens for chunk in data_chunks)
    if output.dim() != 3 or output.shape[1] < ntokens:
        raise ValueError(f"output of shape {tuple(output.shape)} cannot hold the blocks' {ntokens} tokens")
    t0 = 0
    for chunk in data_chunks:
        if chunk.ntokens > chunk_size:
            raise CorruptBlobError(f"token block of {chunk.ntokens} tokens > chunk_size {chunk_size}")
        decode_chunk(cdf, chunk, output[:, t0:t0 + chunk.ntokens], t0)
        t0 += chunk.ntokens


def debug_print_device(output: CacheGenGPUEncoderOutput) -> None:
    """Print the device of each of the output's tensor fields."""
    print({name: getattr(output, name).device for name in _TENSOR_FIELDS})


setattr(CacheGenGPUEncoderOutput, "debug_print_device", debug_print_device)  # noqa: B010
