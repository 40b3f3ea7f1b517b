"""The quantizers (seed names and the codec's RMS steps) and the versioned stream format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache.cachegen import quant as cgq
from lmcache.cachegen.config import CacheGenConfig
from lmcache.cachegen.encoded import CacheGenEncoderOutput, CacheGenGPUEncoderOutput
from lmcache.compat.cachegen_seed import (
    collect_bytes,
    concat_max,
    do_dequantize,
    encode_function,
    quant,
    torch_quant,
    torch_quant_vectorized,
)


def test_torch_quant_error_is_at_most_half_a_bin() -> None:
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(3)) * 4
    for bins in (8, 32, 255):
        xq, max1 = torch_quant(bins, x)
        assert xq.abs().max() <= bins // 2
        assert (quant(bins, xq, max1) - x).abs().max() <= max1 / (bins // 2) / 2 + 1e-6


def test_torch_quant_vectorized_scales_each_token_by_its_max() -> None:
    x = torch.randn(4, 20, 16, generator=torch.Generator().manual_seed(2))
    x *= torch.linspace(0.01, 100, 20)[None, :, None]
    bins = torch.tensor([8, 16, 64, 255])
    q, maxes = torch_quant_vectorized(bins, x)
    assert maxes.shape == (4, 20, 1)
    assert torch.equal(maxes, x.abs().amax(dim=2, keepdim=True))
    assert bool((q.abs() <= (bins // 2)[:, None, None]).all())
    err = (do_dequantize(q, bins, maxes) - x).abs()
    assert bool((err <= maxes / (bins // 2)[:, None, None] / 2 + 1e-5).all())


def _sumsq(x: np.ndarray) -> np.ndarray:
    return cgq.stats_reference(x.astype(np.float32))[1]


def test_step_exponents_follow_rms_and_bins_and_stay_in_window() -> None:
    base = np.random.default_rng(0).standard_normal((1, 10, 64)).astype(np.float32)
    x = np.concatenate([base, base * 100])
    exps = cgq.step_exponents(_sumsq(x), 64, np.array([16, 32]))
    ratio = cgq.steps(exps[1]) / cgq.steps(exps[0])  # 100x the RMS, 2x the bins: ~50x the step
    assert ((ratio > 50 / 2 ** (1 / 8)) & (ratio < 50 * 2 ** (1 / 8))).all()
    rms = np.sqrt((base[0].astype(np.float64) ** 2).mean(1))
    assert np.allclose(cgq.steps(exps[0]), 8 * rms / 16, rtol=2 ** (1 / 16) - 1 + 1e-6)
    x[0, 3] = 1e-30  # a near-zero token: its exponent is pulled into the pair's window
    exps = cgq.step_exponents(_sumsq(x), 64, np.array([16, 16]))
    assert int(exps[0].max() - exps[0].min()) <= cgq.EXP_WINDOW


def test_exponents_and_classes_by_thresholds_are_the_rounded_logarithms() -> None:
    """Both are defined by comparisons with precomputed thresholds (exact in numpy and C alike);
    away from ties they are the rounded logarithms they stand for."""
    from lmcache.cachegen.layout import channel_classes

    rng = np.random.default_rng(5)
    sumsq = rng.lognormal(0.0, 6.0, (40, 300))
    bins = rng.integers(2, 300, 40)
    rms_scaled = np.sqrt(sumsq / 192) * (8.0 / bins)[:, None]
    expected = np.clip(np.rint(8 * np.log2(rms_scaled)), -cgq.EXP_LIMIT, cgq.EXP_LIMIT)
    expected = np.maximum(expected, expected.max(1, keepdims=True) - cgq.EXP_WINDOW)
    assert np.array_equal(cgq.step_exponents(sumsq, 192, bins), expected)
    abs_sum = rng.integers(0, 2**20, (40, 192))
    spread = abs_sum / 256.0 + 0.25
    expected_classes = np.clip(np.floor(2 * np.log2(spread) + 4), 0, 15)
    assert np.array_equal(channel_classes(abs_sum, 256), expected_classes)
    assert channel_classes(np.array([[0, 2**40]]), 1).tolist() == [[0, 15]]


def test_anchor_symbols_split_an_8x_finer_symbol_into_coarse_and_3_bits() -> None:
    x = np.random.default_rng(1).standard_normal((2, 3, 32)).astype(np.float32) * 5
    means = x.mean(axis=1)
    inv = np.full((2, 3), 1.0, np.float32)
    coarse, r = cgq.anchor_symbols(x, means, inv)
    fine = np.rint((x - means[:, None, :]) * 8)
    assert np.array_equal(coarse.astype(np.int64) * 8 + r, fine)
    assert r.max() < cgq.ANCHOR_SCALE and r.dtype == np.uint8
    recon = (coarse + cgq.refinement_values(r)) + means[:, None, :]
    assert np.abs(recon - x).max() <= 1 / 16 + 1e-5  # half of the anchor's step


def test_stats_reference_sums_in_the_defined_order() -> None:
    x = np.random.default_rng(2).standard_normal((3, 5, 21)).astype(np.float32)
    colsum, sumsq = cgq.stats_reference(x)
    assert np.allclose(colsum, x.sum(axis=1), rtol=1e-5)
    assert np.allclose(sumsq, (x.astype(np.float64) ** 2).sum(axis=2), rtol=1e-12)


def test_bound_exponents_keep_symbols_within_qmax() -> None:
    x = np.random.default_rng(1).standard_normal((1, 6, 8)).astype(np.float32)
    x[0, 2] = 1e-4  # tiny token whose channels' means are large
    means = np.full((1, 8), 50.0, np.float32)
    exps = cgq.step_exponents(_sumsq(x), 8, np.array([64]))
    assert cgq.quantize_reference(x, means, cgq.inverse_steps(exps), np.array([0]))[4].max() > cgq.QMAX
    exps = cgq.bound_exponents(x, means, exps)
    assert cgq.quantize_reference(x, means, cgq.inverse_steps(exps), np.array([0]))[4].max() <= cgq.QMAX


def test_concat_max_and_collect_bytes() -> None:
    assert concat_max({1: torch.ones(3, 1), 0: torch.zeros(3)}).tolist() == [[0, 0, 0], [1, 1, 1]]
    buf = torch.arange(12, dtype=torch.uint8).view(3, 4)
    assert collect_bytes(buf, torch.tensor([1, 0, 3])).tolist() == [0, 8, 9, 10]


@pytest.mark.parametrize("lengths", [[1, 5, 0], [1, -1, 0], [1, 2]])
def test_collect_bytes_refuses_lengths_that_do_not_fit_its_rows(lengths) -> None:
    buf = torch.arange(12, dtype=torch.uint8).view(3, 4)  # a length past a row was cut silently
    with pytest.raises(ValueError, match="lengths"):
        collect_bytes(buf, torch.tensor(lengths))


def test_output_classes_roundtrip_through_bytes_field_by_field() -> None:
    kv = torch.randn(2, 3, 70, 12, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    cfg = CacheGenConfig.default_for_layers(3)
    gpu = encode_function(kv, cfg, torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins()), 32)
    flat = gpu.to_flat()
    back = CacheGenEncoderOutput.from_bytes(flat.to_bytes())
    for name in ("cdf", "max_tensors_key", "max_tensors_value", "channel_means",
                 "channel_classes", "symbol_ranges", "key_bins", "value_bins", "start_indices",
                 "block_tokens"):
        assert torch.equal(getattr(back, name).to(getattr(flat, name).dtype),
                           getattr(flat, name)), name
    assert back.bytestream == flat.bytestream
    assert (back.num_heads, back.head_size) == (1, 12)
    gpu2 = CacheGenGPUEncoderOutput.from_bytes(gpu.to_bytes())
    assert [c.ntokens for c in gpu2.data_chunks] == [32, 32, 6]
    for a, b in zip(gpu.data_chunks, gpu2.data_chunks):
        assert torch.equal(a.bytestream, b.bytestream)
        assert torch.equal(a.bytestream_lengths, b.bytestream_lengths)
    assert gpu2.to_bytes() == gpu.to_bytes()
