"""Fit CacheGen's per-layer bin table for SmolLM2-135M (the table in lmcache/cachegen/tables.py).

On the fitting texts only (one per genre, `cachegen_common.FIT`; never the evaluation texts of
cachegen_quality.py):
1. sensitivity: on each text, every (K/V, layer) pair alone is quantized coarsely (bins=6, the rest
   of the KV exact bf16) and the mean KL of the next PROBE_NEXT (64) tokens' distributions is
   measured (fewer than the 256 of the evaluation: 360 probes must fit in minutes); each text's
   sensitivities are normalized to sum 1 and averaged over the texts: w[pair];
2. allocation: with KL ~ w / bins**2 per pair and rate ~ log2(bins), total KL at a given rate
   is smallest for bins ∝ sqrt(w); bins = clamp(round(c * sqrt(w / mean(w))), 3, 96);
3. scale: c is the smallest value (bisection) whose KL on *every* fitting text is <= --target
   (the goal is per genre, so the worst text decides).

Prints the table (paste into lmcache/cachegen/tables.py) and writes
benchmarks/out/cachegen_calibration.json. ~6 minutes on 2 idle cores.

`--layer-count-default` instead fits the default for models without a table
(`CacheGenConfig.default_for_layers`: the same K bins and V bins on every layer): for each V in
--value-grid, the smallest K in --key-grid whose KL on every fitting text is <= --target; of
those, the one with the fewest bits/value (whole blobs, over the fitting texts). Writes
benchmarks/out/cachegen_default_fit.json.

    PYTHONPATH=. python benchmarks/cachegen_calibrate.py [--target 0.0075] [--layer-count-default]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from cachegen_common import FIT, KVModel, kl_and_top1

from lmcache.cachegen.config import CacheGenConfig, specs_from_bins
from lmcache.cachegen.serde import CacheGenDeserializer, CacheGenSerializer
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata

OUT = Path(__file__).with_name("out")
CHUNK = 256
PROBE_BINS = 6
PROBE_NEXT = 64


def blobs(kv: torch.Tensor, cgc: CacheGenConfig, md: LMCacheEngineMetadata) -> list[bytes]:
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)
    ser = CacheGenSerializer(cfg, md, cachegen_config=cgc)
    return [ser.to_bytes(kv[:, :, t:t + CHUNK].contiguous()) for t in range(0, kv.shape[2], CHUNK)]


def roundtrip(kv: torch.Tensor, cgc: CacheGenConfig, md: LMCacheEngineMetadata) -> torch.Tensor:
    de = CacheGenDeserializer(LMCacheEngineConfig.from_defaults(chunk_size=CHUNK), md, kv.dtype)
    return torch.cat([de.from_bytes(b) for b in blobs(kv, cgc, md)], dim=2)


class FitTexts:
    """SmolLM2's bf16 KV of each fitting text's context and the reference next-token
    distributions (from the fp32 KV)."""

    def __init__(self) -> None:
        self.model = model = KVModel()
        self.nl = model.num_layers
        self.md = LMCacheEngineMetadata("calibration", 1, 0, "huggingface", torch.bfloat16,
                                        (self.nl, 2, CHUNK, model.kv_heads, model.head_dim))
        self.texts = []
        for _, file in FIT:
            prompt = model.prompt(file, 1800, 256)
            kv32 = model.kv_of(prompt.context)
            self.texts.append((prompt, kv32.to(torch.bfloat16),
                               model.next_logprobs(kv32, prompt.continuation)))

    def kl_of(self, i: int, decoded: torch.Tensor, nxt: int = 256) -> float:
        prompt, _, ref = self.texts[i]
        logprobs = self.model.next_logprobs(decoded, prompt.continuation[:nxt])
        return float(kl_and_top1(ref[:nxt], logprobs)[0].mean())

    def kls(self, cgc: CacheGenConfig) -> list[float]:
        return [self.kl_of(i, roundtrip(kv, cgc, self.md)) for i, (_, kv, _) in enumerate(self.texts)]

    def bits_per_value(self, cgc: CacheGenConfig) -> float:
        nbytes = sum(len(b) for _, kv, _ in self.texts for b in blobs(kv, cgc, self.md))
        return 8 * nbytes / sum(kv.numel() for _, kv, _ in self.texts)


def fit_table(fit: FitTexts, target: float) -> None:
    nl, md, texts = fit.nl, fit.md, fit.texts
    per_text = torch.zeros(len(texts), 2, nl)
    for i, (prompt, kv, _) in enumerate(texts):
        coarse = roundtrip(kv, CacheGenConfig.uniform(nl, PROBE_BINS, PROBE_BINS), md)
        for kind in range(2):
            for layer in range(nl):
                spliced = kv.clone()
                spliced[kind, layer] = coarse[kind, layer]
                per_text[i, kind, layer] = fit.kl_of(i, spliced, PROBE_NEXT)
        print(f"{prompt.name}: total single-pair KL {float(per_text[i].sum()):.4f}", flush=True)
    w = (per_text / per_text.sum(dim=(1, 2), keepdim=True)).mean(0)
    for kind in range(2):
        print(f"{'KV'[kind]} sensitivity:", " ".join(f"{v:.1e}" for v in w[kind].tolist()))
    shape = (w.clamp_min(1e-7) / w.mean()).sqrt()

    def config(c: float) -> CacheGenConfig:
        bins = (shape * c).round().clamp(3, 96).int().tolist()
        return CacheGenConfig(nl, specs_from_bins(bins[0]), specs_from_bins(bins[1]))

    lo, hi, tried = 8.0, 48.0, {}
    for _ in range(6):
        mid = (lo + hi) / 2
        kls = fit.kls(config(mid))
        tried[mid] = kls
        print(f"c={mid:.2f}: KL max {max(kls):.5f} (" + " ".join(f"{k:.4f}" for k in kls) + ")",
              flush=True)
        lo, hi = (lo, mid) if max(kls) <= target else (mid, hi)
    best = config(hi)
    keys, values = tuple(best.key_bins()), tuple(best.value_bins())
    print(f"\nc={hi:.2f}\n\"smollm2-135m\": (\n    {keys},\n    {values},\n),")
    OUT.mkdir(exist_ok=True)
    (OUT / "cachegen_calibration.json").write_text(json.dumps({
        "texts": [f for _, f in FIT], "probe_bins": PROBE_BINS, "probe_next_tokens": PROBE_NEXT,
        "sensitivity_per_text": per_text.tolist(), "sensitivity": w.tolist(),
        "target_max_kl": target, "scale_tried": tried, "scale": hi,
        "key_bins": keys, "value_bins": values}, indent=2))


def fit_layer_count_default(fit: FitTexts, target: float, key_grid: list[int],
                            value_grid: list[int]) -> None:
    rows = []
    for v in value_grid:
        for k in sorted(key_grid):
            cgc = CacheGenConfig.uniform(fit.nl, k, v)
            kls = fit.kls(cgc)
            rows.append({"key_bins": k, "value_bins": v, "bits_per_value": fit.bits_per_value(cgc),
                         "kl_per_text": kls, "kl_max": max(kls)})
            print(f"K={k} V={v}: {rows[-1]['bits_per_value']:.3f} bits/value, KL max {max(kls):.5f} "
                  "(" + " ".join(f"{x:.4f}" for x in kls) + ")", flush=True)
            if max(kls) <= target:
                break
    ok = [r for r in rows if r["kl_max"] <= target]
    best = min(ok, key=lambda r: r["bits_per_value"]) if ok else None
    print("best:", best if best else f"none of the grid reaches KL <= {target}")
    OUT.mkdir(exist_ok=True)
    (OUT / "cachegen_default_fit.json").write_text(json.dumps({
        "texts": [f for _, f in FIT], "target_max_kl": target, "tried": rows, "best": best},
        indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=float, default=0.0075, help="largest KL on any fitting text")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layer-count-default", action="store_true",
                    help="fit the flat default for models without a table instead")
    ap.add_argument("--key-grid", type=int, nargs="+", default=[24, 28, 32, 36, 40, 48])
    ap.add_argument("--value-grid", type=int, nargs="+", default=[8, 10, 12, 14])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fit = FitTexts()
    if args.layer_count_default:
        fit_layer_count_default(fit, args.target, args.key_grid, args.value_grid)
    else:
        fit_table(fit, args.target)


if __name__ == "__main__":
    main()
