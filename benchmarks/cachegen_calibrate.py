"""Fit CacheGen's per-layer bin table for SmolLM2-135M (the table in cachegen_tables.py).

On the calibration text only (never the evaluation texts of cachegen_quality.py):
1. sensitivity: every (K/V, layer) pair alone is quantized coarsely (bins=6, the rest of the KV
   exact bf16) and the mean KL of the next 256 tokens' distributions is measured: w[pair];
2. allocation: with KL ~ w / bins**2 per pair and rate ~ log2(bins), total KL at a given rate
   is smallest for bins ∝ sqrt(w); bins = clamp(round(c * sqrt(w / mean(w))), 3, 64);
3. scale: c is the smallest value (bisection) whose KL on the calibration text is <= --target.

Prints the table (paste into lmcache/storage_backend/serde/cachegen_tables.py) and writes
benchmarks/out/cachegen_calibration.json. ~2 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from cachegen_common import CALIBRATION_TEXT, KVModel, kl_and_top1

from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.storage_backend.serde.cachegen_basics import CacheGenConfig, specs_from_bins
from lmcache.storage_backend.serde.cachegen_decoder import CacheGenDeserializer
from lmcache.storage_backend.serde.cachegen_encoder import CacheGenSerializer

OUT = Path(__file__).with_name("out")
CHUNK = 256
PROBE_BINS = 6


def roundtrip(kv: torch.Tensor, cgc: CacheGenConfig, md: LMCacheEngineMetadata) -> torch.Tensor:
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)
    ser, de = CacheGenSerializer(cfg, md, cachegen_config=cgc), CacheGenDeserializer(cfg, md, kv.dtype)
    return torch.cat([de.from_bytes(ser.to_bytes(kv[:, :, t:t + CHUNK].contiguous()))
                      for t in range(0, kv.shape[2], CHUNK)], dim=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=float, default=0.008, help="KL of the fitted default")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = KVModel()
    nl = model.num_layers
    md = LMCacheEngineMetadata("calibration", 1, 0, "huggingface", torch.bfloat16,
                               (nl, 2, CHUNK, model.kv_heads, model.head_dim))
    prompt = model.prompt(CALIBRATION_TEXT, 1800, 256)
    kv32 = model.kv_of(prompt.context)
    ref = model.next_logprobs(kv32, prompt.continuation)
    kv = kv32.to(torch.bfloat16)

    def kl_of(decoded: torch.Tensor) -> float:
        return float(kl_and_top1(ref, model.next_logprobs(decoded, prompt.continuation))[0].mean())

    coarse = roundtrip(kv, CacheGenConfig.uniform(nl, PROBE_BINS, PROBE_BINS), md)
    w = torch.zeros(2, nl)
    for i in range(2):
        for layer in range(nl):
            spliced = kv.clone()
            spliced[i, layer] = coarse[i, layer]
            w[i, layer] = kl_of(spliced)
        print(f"{'KV'[i]} sensitivity:", " ".join(f"{v:.1e}" for v in w[i].tolist()), flush=True)
    shape = (w.clamp_min(1e-7) / w.mean()).sqrt()

    def config(c: float) -> CacheGenConfig:
        bins = (shape * c).round().clamp(3, 64).int().tolist()
        return CacheGenConfig(nl, specs_from_bins(bins[0]), specs_from_bins(bins[1]))

    lo, hi, tried = 8.0, 40.0, {}
    for _ in range(6):
        mid = (lo + hi) / 2
        tried[mid] = kl_of(roundtrip(kv, config(mid), md))
        print(f"c={mid:.2f}: KL {tried[mid]:.5f}", flush=True)
        lo, hi = (lo, mid) if tried[mid] <= args.target else (mid, hi)
    best = config(hi)
    keys, values = tuple(best.key_bins()), tuple(best.value_bins())
    print(f"\nc={hi:.2f}\n\"smollm2-135m\": (\n    {keys},\n    {values},\n),")
    OUT.mkdir(exist_ok=True)
    (OUT / "cachegen_calibration.json").write_text(json.dumps({
        "text": CALIBRATION_TEXT, "probe_bins": PROBE_BINS, "sensitivity": w.tolist(),
        "target_kl": args.target, "scale_tried": tried, "scale": hi,
        "key_bins": keys, "value_bins": values}, indent=2))


if __name__ == "__main__":
    main()
