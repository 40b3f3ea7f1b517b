"""The device-agnostic parts of the GPU coder (`lmcache.cachegen.gpu`), checked on the CPU: the
quantizer and dequantizer the CUDA path runs, the symbol checksum that makes a truncated or
altered nvCOMP payload a CorruptBlobError, and the checksum's place in the stream format."""

import numpy as np
import pytest
import torch

from lmcache.cachegen import format as fmt
from lmcache.cachegen import gpu
from lmcache.cachegen.quant import EXP_MIN, steps
from lmcache.storage_backend.serde import blob


def test_quantize_then_dequantize_is_within_half_a_step(make_kv) -> None:
    kv = make_kv()
    nlayers = kv.shape[1]
    bins = torch.full((nlayers,), 32, dtype=torch.int32)
    symbols, means, exps = gpu.quantize(kv, bins, bins)
    assert symbols.dtype == torch.uint8 and symbols.numel() == kv.numel()
    assert int(symbols.min()) >= 128 - gpu.SYMBOL_MAX and int(symbols.max()) <= 128 + gpu.SYMBOL_MAX
    out = gpu.dequantize(symbols, means, torch.from_numpy(exps), torch.float32).reshape(kv.shape)
    step = torch.from_numpy(steps(exps)).reshape(2, nlayers, -1, 1)
    err = (out - kv.float()).abs()
    assert bool((err <= step * (0.5 + 1e-5) + kv.float().abs() * 1e-6).all())
    assert bool((err[:, :, 0] <= step[:, :, 0] * 0.5 + 1e-6).all())  # the anchor, 8x finer


def test_the_symbol_checksum_changes_with_any_byte_and_with_the_length() -> None:
    g = torch.Generator().manual_seed(1)
    symbols = torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=g)
    base = gpu.as_u64(int(gpu.symbol_checksum(symbols)))
    words = np.frombuffer(symbols.numpy().tobytes() + bytes(3), dtype="<u4").astype(object)
    assert base == (1001 + sum(int(w) * (2 * j + 1) for j, w in enumerate(words))) % 2 ** 64
    for pos in (0, 1, 2, 3, 500, 1000):
        changed = symbols.clone()
        changed[pos] ^= 0x5A
        assert gpu.as_u64(int(gpu.symbol_checksum(changed))) != base
    assert gpu.as_u64(int(gpu.symbol_checksum(symbols[:1000]))) != base
    swapped = symbols.clone()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert symbols[10] == symbols[20] or gpu.as_u64(int(gpu.symbol_checksum(swapped))) != base


def _nvcomp_stream(good: bytes, stream_of, checksum: int) -> bytes:
    out = stream_of(good)
    out.coder = fmt.CODER_NVCOMP
    out.bytestream = bytes(range(64))
    out.start_indices = torch.tensor([[0, 64]])
    out.symbol_ranges = torch.empty(0, 2, dtype=torch.int32)
    out.symbol_checksum = checksum
    return out.to_bytes()


def test_an_nvcomp_stream_carries_its_symbol_checksum(serde, make_kv, stream_of) -> None:
    good = serde[0].to_bytes(make_kv())
    head = blob.unpack(good)
    payload = _nvcomp_stream(good, stream_of, 2 ** 64 - 5)
    back = stream_of(blob.pack_header("cachegen", head.shape, head.dtype, payload) + payload)
    assert back.coder == fmt.CODER_NVCOMP and back.symbol_checksum == 2 ** 64 - 5
    assert back.bytestream == bytes(range(64))


def test_an_nvcomp_stream_without_the_checksum_is_stale(serde, make_kv, stream_of) -> None:
    payload = bytearray(_nvcomp_stream(serde[0].to_bytes(make_kv()), stream_of, 7))
    payload[5] = fmt.CODER_NVCOMP_UNCHECKED
    with pytest.raises(fmt.StaleStreamError, match="symbol checksum"):
        fmt.unpack(bytes(payload))


def test_a_gpu_coded_stream_of_tiny_kv_keeps_its_anchor_exponents(dims) -> None:
    """KV of 1e-30 gets the finest step, and the GPU coder's anchors one 8x finer still: the
    lowest exponent a stream may hold (`quant.EXP_MIN`), which the parser must accept."""
    nlayers, hidden = dims["nlayers"], dims["hidden"]
    bins = torch.full((nlayers,), 32, dtype=torch.int32)
    _, means, exps = gpu.quantize(torch.full((2, nlayers, 8, hidden), 1e-30), bins, bins)
    assert int(exps.min()) == EXP_MIN
    parts = fmt.pack_fields(fmt.CODER_NVCOMP, 1, hidden, bins.numpy(), bins.numpy(), np.array([8]),
                            means.to(torch.bfloat16).view(torch.int16).numpy(), exps, None, bytes(64), 1)
    fields = fmt.unpack(b"".join(parts))
    assert int(fields["max_tensors_key"].min()) == EXP_MIN
