"""CacheGen on a CUDA device: the quantizer in torch, entropy coding with nvCOMP's ANS codec.

Used wherever torch sees CUDA and ``nvidia.nvcomp`` imports: installing the optional extra
``lmcache[gpu]`` (NVIDIA's nvCOMP wheels) on a CUDA machine opts in, also for KV that reaches the
serializer in host memory (the engine's arena; it is copied to the device, ~55 GB/s pinned).
Readers without CUDA or nvCOMP cannot decode such streams (a miss), so a fleet that mixes CPU-only
readers with GPU writers should leave the extra out. Nothing here runs on a CPU-only machine
except the device-agnostic pieces (`quantize`, `dequantize`, `symbol_checksum`), which CI tests.

Encode (on the device): the quantizer of `quant` (per-channel means, RMS-relative steps; the
anchor token gets a step 8x finer instead of refinement bits), with steps raised where needed so
that ``|q| <= 127``; symbols ``q + 128`` as uint8, one (K/V, layer) pair after another,
channel-major (each channel's tokens contiguous), coded in ONE nvCOMP ANS call (nvCOMP cuts the
buffer into 64 KiB chunks with their own tables and codes them all in one batched launch, which
adapts to the pairs' different spreads). The small per-token exponent arithmetic runs on the host
on ``[G, T]`` arrays, fetched in one device-to-host copy (the encode's first of two host
synchronisations; the second waits for nvCOMP's output size and the coded bytes). The stream
(`format`, coder 3) holds the means, the exponents, a checksum of the symbols and nvCOMP's
container as the payload.

Decode: the payload goes to the device through pinned memory, nvCOMP decodes it, the symbols'
checksum is compared with the stream's (the one host synchronisation), and ``q * step + mean``
runs on the device. A process without CUDA or nvCOMP raises `UnavailableCoderError` (a miss; the
value is kept for readers that can decode it); a payload nvCOMP rejects, that decodes to the wrong
size or to symbols whose checksum differs raises `CorruptBlobError`.

Why the checksum: nvCOMP's container records its own compressed size and chunk offsets, and its
Python ``decode`` does not check them against the buffer it is given. A container cut short and
re-framed (the case issue 36's device run caught: half the payload, with a fresh, consistent blob
header) decoded *without error* to garbage of the right size, nvCOMP reading past the buffer's end.
The blob checksum cannot catch that (the writer computed it over the bad bytes), so the stream
carries a checksum of what the payload must decode to: wrong symbols are a CorruptBlobError, never
wrong KV. (It cannot stop nvCOMP's out-of-bounds *read* itself; that read stays inside torch's
caching-allocator block in practice, and a stream from a correct writer never triggers it.)

Why nvCOMP rather than a device port of the rANS coder: nvCOMP's ANS is NVIDIA's tuned kernel
(measured for this project on an H100 at ~290 GB/s encode / ~440 GB/s decode of the bf16 KV the
symbols stand for, within ~0.3 bits/value of the symbols' entropy). The price: such streams decode
only where CUDA is.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

import numpy as np
import torch

from lmcache.cachegen import format as fmt
from lmcache.cachegen import quant
from lmcache.cachegen.encoded import (
    CacheGenEncoderOutput,
    CacheGenGPUBytestream,
    CacheGenGPUEncoderOutput,
)
from lmcache.storage_backend.serde.serde import CorruptBlobError

SYMBOL_MAX = 127
_OFFSET = 128
_MASK64 = (1 << 64) - 1
_local = threading.local()


@functools.cache
def _nvcomp() -> Any | None:
    try:
        from nvidia import nvcomp  # type: ignore[import-not-found]
    except ImportError:
        return None
    return nvcomp


def available() -> bool:
    """True where CUDA and nvCOMP are both present."""
    return torch.cuda.is_available() and _nvcomp() is not None


def _module() -> Any:
    nvcomp = _nvcomp()
    assert nvcomp is not None, "nvCOMP is not installed"
    return nvcomp


def _codec() -> Any:
    """An ANS codec on torch's current stream (so its work is ordered with torch's, with no
    cross-stream synchronisation), made once per thread and stream: making one costs far more
    than a small chunk's encode."""
    stream = torch.cuda.current_stream()
    codecs = getattr(_local, "codecs", None)
    if codecs is None:
        codecs = _local.codecs = {}
    key = (stream.device_index, stream.cuda_stream)
    codec = codecs.get(key)
    if codec is None:
        codec = codecs[key] = _module().Codec(algorithm="ANS", device_id=stream.device_index,
                                              cuda_stream=stream.cuda_stream)
    return codec


def symbol_checksum(symbols: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N]`` symbols (any device) -> int64 scalar on their device:
    ``N + sum_j w_j * (2 j + 1)  (mod 2**64)`` over the little-endian 32-bit words ``w_j`` of the
    symbols (zero-padded). Any change of one byte changes it (an odd weight times a nonzero
    difference below 2**32 is nonzero mod 2**64); sums mod 2**64 do not depend on the order of
    the reduction, so CPU and CUDA agree."""
    n = symbols.numel()
    if n % 4:
        symbols = torch.cat([symbols, symbols.new_zeros(4 - n % 4)])
    words = symbols.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    weights = torch.arange(1, 2 * words.numel(), 2, dtype=torch.int64, device=symbols.device)
    return (words * weights).sum() + n


def as_u64(checksum: int) -> int:
    """A `symbol_checksum` value (int64, may be negative) as the unsigned u64 the stream holds."""
    return int(checksum) & _MASK64


class Quantized(NamedTuple):
    """symbols: uint8 ``[G * C * T]`` on the device (pair-major, then channel-major); means:
    bf16-rounded float32 ``[G, C]`` on the device; exps: int32 ``[G, T]`` numpy."""

    symbols: torch.Tensor
    means: torch.Tensor
    exps: np.ndarray


def quantize(kv: torch.Tensor, key_bins: torch.Tensor, value_bins: torch.Tensor) -> Quantized:
    """kv ``[2, L, T, C]`` (any device) -> the symbols nvCOMP codes. One device-to-host copy of
    ``[2, G, T]`` statistics; the rest stays on kv's device. Raises ValueError for non-finite KV."""
    two, nlayers, ntok, nch = kv.shape
    x = kv.reshape(two * nlayers, ntok, nch).float()
    means = (x.sum(dim=1) / ntok).to(torch.bfloat16).float()  # [G, C]
    centered = x - means[:, None, :]
    stats = torch.stack([x.square().sum(dim=2, dtype=torch.float64),
                         centered.abs().amax(dim=2).double()]).cpu().numpy()  # [2, G, T]
    sumsq, peak = stats
    if not np.isfinite(stats).all():
        raise ValueError(quant.NON_FINITE)
    bins = np.concatenate([np.asarray(key_bins, np.int64), np.asarray(value_bins, np.int64)])
    exps = quant.step_exponents(sumsq, nch, bins)
    exps[:, 0] -= quant.ANCHOR_BITS * quant.STEPS_PER_OCTAVE  # the anchor: 8x finer
    exps = quant.bounded(exps, peak, SYMBOL_MAX)
    inv = torch.from_numpy(quant.inverse_steps(exps))
    inv = (inv.pin_memory() if kv.is_cuda else inv).to(kv.device, non_blocking=True)
    q = centered.mul_(inv[:, :, None]).round_().clamp_(-SYMBOL_MAX, SYMBOL_MAX).add_(_OFFSET)
    symbols = q.to(torch.uint8).transpose(1, 2).contiguous().reshape(-1)  # [G, C, T]
    return Quantized(symbols, means, exps)


def dequantize(symbols: torch.Tensor, means: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor:
    """uint8 ``[G * C * T]`` symbols, float32 means ``[G, C]`` and int exponents ``[G, T]`` (all on
    one device) -> KV ``[G, T, C]`` of `dtype`: ``(s - 128) * 2 ** (e / 8) + mean``."""
    npairs, nch = means.shape
    ntok = exps.shape[1]
    table = _step_table(symbols.device)
    step = table[(exps.to(torch.int64) + quant.EXP_LIMIT).clamp_(0, table.numel() - 1)]
    values = symbols.reshape(npairs, nch, ntok).float().sub_(_OFFSET).mul_(step[:, None, :])
    values.add_(means[:, :, None])
    out = torch.empty((npairs, ntok, nch), dtype=dtype, device=symbols.device)
    return out.copy_(values.transpose(1, 2))  # one pass: transpose and convert


@functools.cache
def _step_table(device: torch.device) -> torch.Tensor:
    """float32 ``2 ** (e / 8)`` (`quant.steps`) of every exponent, at ``e + EXP_LIMIT``."""
    exps = np.arange(-quant.EXP_LIMIT, quant.EXP_LIMIT + 1)
    return torch.from_numpy(quant.steps(exps)).to(device)


def encode(kv: torch.Tensor, key_bins: torch.Tensor, value_bins: torch.Tensor
           ) -> CacheGenGPUEncoderOutput:
    """kv [2, L, T, C] (CUDA, or host memory moved to the device) -> one nvCOMP-coded block
    (num_heads=1, head_size=C)."""
    kv = kv if kv.is_cuda else kv.cuda(non_blocking=kv.is_pinned())
    nlayers, ntok = kv.shape[1], kv.shape[2]
    with torch.cuda.device(kv.device):
        symbols, means, exps = quantize(kv, key_bins, value_bins)
        checksum = symbol_checksum(symbols)
        packed = _codec().encode(_module().as_array(symbols))
        device_bytes = torch.as_tensor(packed, device=kv.device).view(torch.uint8).reshape(-1)
        nbytes = int(packed.buffer_size)
        payload = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        payload.copy_(device_bytes[:nbytes], non_blocking=True)
        host_means = means.to(torch.bfloat16).to("cpu", non_blocking=True)
        host_checksum = checksum.to("cpu", non_blocking=True)
        torch.cuda.current_stream().synchronize()
    e16 = torch.from_numpy(exps.astype(np.int16)).reshape(2, nlayers, ntok)
    return CacheGenGPUEncoderOutput(
        [CacheGenGPUBytestream(payload, torch.tensor([nbytes]), ntok)],
        torch.empty(0, dtype=torch.int32), e16[0], e16[1], 1, means.shape[1],
        channel_means=host_means.reshape(2, nlayers, -1),
        channel_classes=torch.empty(0, dtype=torch.uint8),
        symbol_ranges=torch.empty(0, 2, dtype=torch.int32),
        key_bins=torch.as_tensor(key_bins, dtype=torch.int32),
        value_bins=torch.as_tensor(value_bins, dtype=torch.int32), coder=fmt.CODER_NVCOMP,
        symbol_checksum=as_u64(int(host_checksum)))


def decode(encoded: CacheGenEncoderOutput, dtype: torch.dtype) -> torch.Tensor:
    """An nvCOMP-coded stream -> KV [2, L, T, C] of `dtype` on the CUDA device.

    Raises UnavailableCoderError without CUDA or nvCOMP, CorruptBlobError for a bad payload."""
    if not available():
        raise fmt.UnavailableCoderError(
            "this CacheGen stream was entropy-coded on a GPU with nvCOMP; decoding it needs CUDA "
            "and nvCOMP (pip install 'lmcache[gpu]')")
    nlayers, ntok = encoded.max_tensors_key.shape
    nch = encoded.channel_means.shape[-1]
    device = torch.device("cuda", torch.cuda.current_device())
    host = torch.empty(len(encoded.bytestream), dtype=torch.uint8, pin_memory=True)
    host.numpy()[:] = np.frombuffer(encoded.bytestream, dtype=np.uint8)
    packed = host.to(device, non_blocking=True)
    exps = torch.stack([encoded.max_tensors_key, encoded.max_tensors_value]).reshape(2 * nlayers, ntok)
    exps = exps.to(torch.int32).pin_memory().to(device, non_blocking=True)
    means = encoded.channel_means.reshape(2 * nlayers, nch).pin_memory().to(device, non_blocking=True)
    try:
        decoded = _codec().decode(_module().as_array(packed))
        symbols = torch.as_tensor(decoded, device=device).view(torch.uint8).reshape(-1)
    except Exception as e:  # nvCOMP rejects a corrupt container in its own ways
        raise CorruptBlobError(f"nvCOMP could not decode the cachegen payload: {e}") from e
    if symbols.numel() != 2 * nlayers * nch * ntok:
        raise CorruptBlobError(f"nvCOMP payload holds {symbols.numel()} symbols, the stream "
                               f"needs {2 * nlayers * nch * ntok}")
    values = dequantize(symbols, means.float(), exps, dtype)  # queued behind the checksum's wait
    if as_u64(int(symbol_checksum(symbols))) != encoded.symbol_checksum:
        raise CorruptBlobError("the nvCOMP payload decodes to symbols whose checksum differs from "
                               "the stream's (a truncated or altered nvCOMP container)")
    return values.reshape(2, nlayers, ntok, nch)
