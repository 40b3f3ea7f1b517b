"""CacheGen on a CUDA device: the quantizer in torch, entropy coding with nvCOMP's ANS codec.

Used wherever torch sees CUDA and ``nvidia.nvcomp`` imports: installing the optional extra
``lmcache[gpu]`` (NVIDIA's nvCOMP wheels) on a CUDA machine opts in, also for KV that reaches the
serializer in host memory (the engine's arena; it is copied to the device, ~55 GB/s pinned).
Readers without CUDA or nvCOMP cannot decode such streams (a miss), so a fleet that mixes CPU-only
readers with GPU writers should leave the extra out. Nothing here runs on a CPU-only machine.

Encode (all on the device): the quantizer of `quant` (per-channel means, RMS-relative
steps; the small per-token exponent arithmetic runs on the host on ``[G, T]`` arrays; the anchor
token gets a step 8x finer instead of refinement bits), with steps raised where needed so that
``|q| <= 127``; symbols ``q + 128`` as uint8, one
(K/V, layer) pair after another, channel-major (each channel's tokens contiguous), coded in one
nvCOMP ANS call (nvCOMP cuts the buffer into chunks with their own tables, which adapt to the
pairs' different spreads). The stream (`format`, coder 2) holds the means and exponents
like a rANS stream, and nvCOMP's container as the payload.

Decode: nvCOMP on the device, then ``q * step + mean`` on the device. The nvCOMP calls are the
ones DESIGN.md lists as verified on an H100 (`Codec(algorithm="ANS")`, `as_array` of a CUDA uint8
tensor, `encode` / `decode`, `buffer_size`, `torch.as_tensor(..., device="cuda")`); this module
itself has not run on a GPU yet (no GPU was available to its author). A process without CUDA or
nvCOMP raises `UnavailableCoderError` (a miss; the value is kept for readers that can decode it);
a payload nvCOMP rejects, or that decodes to the wrong size, raises `CorruptBlobError`.

Why nvCOMP rather than a device port of the rANS coder: nvCOMP's ANS is NVIDIA's tuned kernel
(measured for this project on an H100 at ~290 GB/s encode / ~440 GB/s decode of the bf16 KV the
symbols stand for, within ~0.3 bits/value of the symbols' entropy), where a new kernel could not
be run or measured on this project's CPU-only machines. The price: such streams decode only
where CUDA is.
"""

from __future__ import annotations

import functools
from typing import Any

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
    return _module().Codec(algorithm="ANS")


def encode(kv: torch.Tensor, key_bins: torch.Tensor, value_bins: torch.Tensor
           ) -> CacheGenGPUEncoderOutput:
    """kv [2, L, T, C] (CUDA, or host memory moved to the device) -> one nvCOMP-coded block
    (num_heads=1, head_size=C)."""
    kv = kv if kv.is_cuda else kv.cuda(non_blocking=kv.is_pinned())
    two, nlayers, ntok, nch = kv.shape
    x = kv.reshape(two * nlayers, ntok, nch).float()
    means = (x.sum(dim=1) / ntok).to(torch.bfloat16).float()  # [G, C]
    sumsq = x.double().square().sum(dim=2)  # [G, T]
    if not bool(torch.isfinite(sumsq).all()):
        raise ValueError(quant.NON_FINITE)
    bins = np.concatenate([np.asarray(key_bins, np.int64), np.asarray(value_bins, np.int64)])
    exps = quant.step_exponents(sumsq.cpu().numpy(), nch, bins)
    exps[:, 0] -= quant.ANCHOR_BITS * quant.STEPS_PER_OCTAVE  # the anchor: 8x finer
    centered = x - means[:, None, :]
    exps = quant.bounded(exps, centered.abs().amax(dim=2).cpu().numpy(), SYMBOL_MAX)
    inv = torch.from_numpy(quant.inverse_steps(exps)).to(kv.device)  # (host exps: small)
    q = torch.round(centered * inv[:, :, None]).clamp_(-SYMBOL_MAX, SYMBOL_MAX)
    symbols = (q + _OFFSET).to(torch.uint8).transpose(1, 2).contiguous()  # [G, C, T]
    packed = _codec().encode(_module().as_array(symbols.reshape(-1)))
    device_bytes = torch.as_tensor(packed, device="cuda").view(torch.uint8).reshape(-1)
    payload = device_bytes[: packed.buffer_size].cpu()
    e16 = torch.from_numpy(exps.astype(np.int16)).reshape(2, nlayers, ntok)
    return CacheGenGPUEncoderOutput(
        [CacheGenGPUBytestream(payload, torch.tensor([len(payload)]), ntok)],
        torch.empty(0, dtype=torch.int32), e16[0], e16[1], 1, nch,
        channel_means=means.to(torch.bfloat16).cpu().reshape(2, nlayers, nch),
        channel_classes=torch.empty(0, dtype=torch.uint8),
        symbol_ranges=torch.empty(0, 2, dtype=torch.int32),
        key_bins=torch.as_tensor(key_bins, dtype=torch.int32),
        value_bins=torch.as_tensor(value_bins, dtype=torch.int32), coder=fmt.CODER_NVCOMP)


def decode(encoded: CacheGenEncoderOutput, dtype: torch.dtype) -> torch.Tensor:
    """An nvCOMP-coded stream -> KV [2, L, T, C] of `dtype` on the CUDA device.

    Raises UnavailableCoderError without CUDA or nvCOMP, CorruptBlobError for a bad payload."""
    if not available():
        raise fmt.UnavailableCoderError(
            "this CacheGen stream was entropy-coded on a GPU with nvCOMP; decoding it needs CUDA "
            "and nvCOMP (pip install 'lmcache[gpu]')")
    nlayers, ntok = encoded.max_tensors_key.shape
    means = encoded.channel_means.reshape(2 * nlayers, -1).cuda().float()
    nch = means.shape[1]
    try:
        packed = torch.frombuffer(bytearray(encoded.bytestream), dtype=torch.uint8).cuda()
        decoded = _codec().decode(_module().as_array(packed))
        symbols = torch.as_tensor(decoded, device="cuda").view(torch.uint8).reshape(-1)
    except Exception as e:  # nvCOMP rejects a corrupt container in its own ways
        raise CorruptBlobError(f"nvCOMP could not decode the cachegen payload: {e}") from e
    if symbols.numel() != 2 * nlayers * nch * ntok:
        raise CorruptBlobError(f"nvCOMP payload holds {symbols.numel()} symbols, the stream "
                               f"needs {2 * nlayers * nch * ntok}")
    exps = torch.stack([encoded.max_tensors_key, encoded.max_tensors_value]).reshape(2 * nlayers, ntok)
    step = torch.from_numpy(quant.steps(exps.numpy())).cuda()
    q = symbols.reshape(2 * nlayers, nch, ntok).float().sub_(_OFFSET)
    values = q.mul_(step[:, None, :]).add_(means[:, :, None]).transpose(1, 2)
    return values.to(dtype).reshape(2, nlayers, ntok, nch)
