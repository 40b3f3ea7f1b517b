"""CacheGen's quantizer: per-channel means, RMS-relative per-token steps, anchor tokens.

The KV of one encode call is handled token-major, ``x: [G, T, C]`` (G = 2 * nlayers (K/V, layer)
pairs, T tokens, C = hidden channels); for each pair g:

    mean[g, c]  = (sum_t x[g, t, c]) / T in float32, rounded to bf16 (stored)
    e[g, t]     = round(8 * log2(8 * rms_c(x[g, t, :]) / bins[g]))
    step[g, t]  = 2 ** (e[g, t] / 8)
    q[g, t, c]  = rint((x[g, t, c] - mean[g, c]) * (1 / step[g, t]))     (signed integers)
    x_hat       = q * step + mean          so |x - x_hat| <= step / 2 (+ float rounding)

    anchor tokens (the first of each token block) get ANCHOR_BITS more:
    f           = rint(8 * (x - mean) * (1 / step)),  q = floor(f / 8),  r = f - 8 q in [0, 8)
    x_hat       = (q + r / 8) * step + mean     (q coded like any symbol, r as 3 raw bits)

The data passes (sums, quantization) run in `kernels` (native or numpy, bit-identical);
this module holds the arithmetic between them and the numpy reference of those passes, so the
rounding of every intermediate is defined here once.

Why these choices (SmolLM2-135M KV of real text; KL of the next-token distribution):
- Steps relative to the token's RMS rather than to its max (the seed's `torch_quant_vectorized`):
  3.09 bits/value at KL 0.0075, where per-token max scaling needs ~3.5 — the max is set by a few
  outlier channels. One step per layer or per channel gives 6x / 12x the KL at equal bits.
- Subtracting the per-channel mean over the chunk's tokens is a lossless rate gain (keys: 3.01
  -> 2.49 bits/value at equal error; their RoPE'd outlier channels carry a large offset shared by
  neighbouring tokens). Closed-loop deltas against the previous token measured worse (keys 2.32
  vs 2.25 bits/value with per-class tables, values 3.42 vs 3.02).
- Anchor tokens: the first token of every token block is coded 8x finer. The first token of a
  sequence is the attention sink (most heads put much of their weight on it), so its error reaches
  every later position; coding it exactly cut the mean KL over ten texts of six genres from 0.0141
  to 0.0102 (`benchmarks/RESULTS.md`). Its coarse symbol q has the usual distribution (so the
  frequency tables do not widen: coding the anchor's fine symbols in the tables widened every
  group's range and cost +0.11 bits/value in table bytes), and the 3 refinement bits are stored raw
  (3 bits on one token in 256: ~0.012 bits/value).

Steps are stored as exponents ``e`` (1/8 octave): all exponents of one pair lie within a
255-code window below the pair's largest, and a token's step is raised where needed so that
``|q| <= QMAX`` (`bound_exponents`, rare).
"""

from __future__ import annotations

import numpy as np
import torch

STEPS_PER_OCTAVE = 8
RANGE_IN_RMS = 8.0  # `bins` steps span +-4 RMS of the token
ANCHOR_BITS = 3
ANCHOR_SCALE = 1 << ANCHOR_BITS
QMAX = 2047
EXP_LIMIT = 100 * STEPS_PER_OCTAVE  # steps within 2**-100 .. 2**100
EXP_MIN = -EXP_LIMIT - ANCHOR_BITS * STEPS_PER_OCTAVE  # the lowest exponent (a GPU-coded anchor's)
EXP_WINDOW = 255
NON_FINITE = "cannot CacheGen-encode non-finite KV values (or values too large to sum)"
PARTIALS = 8  # sum of squares: 8 partial sums over channels c = j (mod 8)
# r2 >= EXP_THRESHOLDS[i] <=> 4 * log2(r2) >= i - EXP_LIMIT + 1/2 (see `step_exponents`)
EXP_THRESHOLDS = np.exp2((np.arange(-EXP_LIMIT, EXP_LIMIT) + 0.5) / (STEPS_PER_OCTAVE / 2))
# float32 2 ** (-e / 8) of every exponent e, at e + EXP_LIMIT
INVERSE_STEPS = np.exp2(np.arange(-EXP_LIMIT, EXP_LIMIT + 1, dtype=np.float64)
                        / -STEPS_PER_OCTAVE).astype(np.float32)


def as_float32(x: torch.Tensor) -> np.ndarray:
    """KV of any float dtype -> float32 numpy array (exact for bf16 / fp16 / fp32)."""
    return x.detach().cpu().float().numpy()


def stats_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: float32 [G, T, C] -> (colsum float32 [G, C] summed over t in order, sumsq float64
    [G, T] as PARTIALS partial sums over c combined pairwise) — the definition `cg_stats` follows."""
    colsum = np.zeros((x.shape[0], x.shape[2]), np.float32)
    for t in range(x.shape[1]):
        colsum += x[:, t]
    sq = x.astype(np.float64) ** 2
    pad = -x.shape[2] % PARTIALS
    if pad:
        sq = np.concatenate([sq, np.zeros((*x.shape[:2], pad))], axis=2)
    sq = sq.reshape(*x.shape[:2], -1, PARTIALS)
    parts = np.zeros((*x.shape[:2], PARTIALS))
    for k in range(sq.shape[2]):
        parts += sq[:, :, k]
    pairs = parts[..., 0::2] + parts[..., 1::2]
    return colsum, (pairs[..., 0] + pairs[..., 1]) + (pairs[..., 2] + pairs[..., 3])


def channel_means(colsum: np.ndarray, ntok: int) -> np.ndarray:
    """colsum float32 [G, C] -> means float32 [G, C] (sum / T in float32, rounded to bf16)."""
    means = colsum / np.float32(ntok)
    return torch.from_numpy(means).to(torch.bfloat16).float().numpy()


def step_exponents(sumsq: np.ndarray, nch: int, bins: np.ndarray) -> np.ndarray:
    """sumsq float64 [G, T], bins [G] -> int32 exponents e [G, T], windowed per pair.

    e = round(8 * log2(8 * rms / bins)) = round(4 * log2(r2)), r2 = sumsq / C * (8 / bins)^2,
    decided by comparing r2 with `EXP_THRESHOLDS` (no log2, whose last bit could differ between
    numpy and the native kernels). Raises ValueError for non-finite (or absurdly large) inputs."""
    if not np.isfinite(sumsq).all():
        raise ValueError(NON_FINITE)
    scale = RANGE_IN_RMS / np.asarray(bins, np.float64)
    r2 = (sumsq / nch) * (scale * scale)[:, None]
    exps = np.searchsorted(EXP_THRESHOLDS, r2, side="right") - EXP_LIMIT
    return _windowed(exps.astype(np.int32))


def _windowed(exps: np.ndarray) -> np.ndarray:
    """Raise exponents below ``max - EXP_WINDOW`` of their pair (so they fit the stored window)."""
    return np.maximum(exps, exps.max(axis=1, keepdims=True) - EXP_WINDOW)


def steps(exps: np.ndarray) -> np.ndarray:
    """int exponents [...] -> float32 steps 2 ** (e / 8)."""
    return np.exp2(np.asarray(exps, np.float64) / STEPS_PER_OCTAVE).astype(np.float32)


def inverse_steps(exps: np.ndarray) -> np.ndarray:
    """int exponents [...] -> float32 2 ** (-e / 8)."""
    return INVERSE_STEPS[np.asarray(exps, np.int64) + EXP_LIMIT]


def quantize_reference(x: np.ndarray, means: np.ndarray, inv_steps: np.ndarray,
                       anchors: np.ndarray) -> tuple[np.ndarray, ...]:
    """The definition `cg_quantize` follows. x float32 [G, T, C], means [G, C], inv_steps [G, T],
    anchor token indices [A] -> (q int16 [G, T, C] (anchor rows: their coarse symbols), abs_sum
    int64 [G, C], qmin int32 [G, C], qmax int32 [G, C], qpeak int32 [G, T] (max |q| of each
    token), refinements uint8 [A, G, C]), the statistics taken over q as returned."""
    v = (x - means[:, None, :]) * inv_steps[:, :, None]
    q = np.rint(np.clip(v, -32767.0, 32767.0)).astype(np.int32)
    coarse, refine = _split_anchors(v[:, anchors])
    q[:, anchors] = coarse
    a = np.abs(q)
    return (q.astype(np.int16), a.sum(axis=1, dtype=np.int64), q.min(axis=1), q.max(axis=1),
            a.max(axis=2), refine.transpose(1, 0, 2).copy())


def bound_exponents(x: np.ndarray, means: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """Raise the exponents of tokens whose |q| would exceed QMAX (rare: a token far smaller
    than its channels' means). x float32 [G, T, C] (unquantized), means [G, C], exps [G, T]."""
    return bounded(exps, np.abs(x - means[:, None, :]).max(axis=2), QMAX)


def bounded(exps: np.ndarray, peak: np.ndarray, qmax: int) -> np.ndarray:
    """exps int32 [G, T] raised where needed so that a token whose largest |x - mean| is
    peak [G, T] quantizes to |q| <= qmax."""
    with np.errstate(divide="ignore"):
        needed = np.ceil(np.log2(peak.astype(np.float64) / (qmax - 1)) * STEPS_PER_OCTAVE)
    needed = np.nan_to_num(needed, nan=-EXP_LIMIT, neginf=-EXP_LIMIT).astype(np.int32)
    return _windowed(np.minimum(np.maximum(exps, needed), EXP_LIMIT))


def anchor_symbols(x: np.ndarray, means: np.ndarray, inv_steps: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Anchor tokens x float32 [G, A, C], means [G, C], inv_steps [G, A] -> (coarse symbols q
    int16 [G, A, C], refinements r uint8 [G, A, C] in [0, ANCHOR_SCALE))."""
    coarse, refine = _split_anchors((x - means[:, None, :]) * inv_steps[:, :, None])
    return coarse.astype(np.int16), refine


def _split_anchors(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scaled anchor values v = (x - mean) / step float32 -> (coarse int32, refinement uint8)."""
    fine = np.rint(np.clip(v, -QMAX - 1, QMAX + 1) * np.float32(ANCHOR_SCALE)).astype(np.int32)
    coarse = np.floor_divide(fine, ANCHOR_SCALE)
    return coarse, (fine - coarse * ANCHOR_SCALE).astype(np.uint8)


def refinement_values(r: np.ndarray) -> np.ndarray:
    """Refinements uint8 -> the float32 fractions r / ANCHOR_SCALE added to anchor symbols."""
    return r.astype(np.float32) / np.float32(ANCHOR_SCALE)


def dequantize_reference(q: np.ndarray, means: np.ndarray, step: np.ndarray,
                         anchors: np.ndarray, refine: np.ndarray) -> np.ndarray:
    """q int [G, T, C], means float32 [G, C], step float32 [G, T], anchor token indices [A],
    refinement fractions float32 [A, G, C] -> float32 ``(q [+ r / 8]) * step + mean`` (the
    definition `cg_decode` follows before rounding to the output dtype)."""
    sym = q.astype(np.float32)
    sym[:, anchors, :] += refine.transpose(1, 0, 2)
    return sym * step[:, :, None] + means[:, None, :]
