"""Where CacheGen's entropy-coding time goes: constriction used four ways on the same symbols.

The symbols are CacheGen's own (default SmolLM2 table) for 256-token chunks of real KV
(Moby-Dick context). Each way codes exactly those integers; speeds are M values/s (one value =
2 bytes of bf16 input, so MB/s = 2 x M values/s), best of --repeats, single thread:

1. range coder, one categorical model per symbol (constriction's model family with a
   probability row per symbol; measured on the first 4 (K/V, layer) pairs only — its tables
   alone would need GBs for a whole chunk);
2. ANS, one model per (K/V, layer, channel) run of 256 tokens (the seed's per-channel CDFs);
3. ANS, one model per (K/V, layer, channel class) group, one call per group;
4. as 3, plus tuples of 2-4 symbols per coded symbol for small alphabets — CacheGen's path
   (`cachegen_coder`).

Bits are the payload only (tables excluded; way 2 would also have to ship its
per-channel tables (1-2 bits/value); way 1 codes other data, 4 pairs, so its bits are not comparable).
Prints a table and writes benchmarks/out/cachegen_coder_speed.json.
    python benchmarks/cachegen_coder_speed.py [--chunks 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import constriction
import numpy as np
import torch
from cachegen_common import EVAL_TEXTS, KVModel

from lmcache.storage_backend.serde import cachegen_coder as coder
from lmcache.storage_backend.serde.cachegen_basics import CacheGenConfig
from lmcache.storage_backend.serde.cachegen_encoder import CacheGenEncoderImpl, SymbolTables

OUT = Path(__file__).with_name("out")
Cat = constriction.stream.model.Categorical
Ans = constriction.stream.stack.AnsCoder


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def per_symbol_range(rows: np.ndarray, size: int, repeats: int) -> tuple[float, float, float]:
    """rows [pairs, C, T] in [0, size): one probability row per symbol (its channel's table)."""
    flat = rows.reshape(-1).astype(np.int32)
    tables = np.stack([np.bincount(r.reshape(-1), minlength=size) + 0.01
                       for r in rows.reshape(-1, rows.shape[-1])])
    probs = np.repeat(tables, rows.shape[-1], axis=0).astype(np.float32)
    family = Cat(perfect=False)
    enc = constriction.stream.queue.RangeEncoder()
    t_enc = best(lambda: (enc.clear(), enc.encode(flat, family, probs)), repeats)
    words = enc.get_compressed()
    t_dec = best(lambda: constriction.stream.queue.RangeDecoder(words).decode(family, probs), repeats)
    return flat.size / t_enc / 1e6, flat.size / t_dec / 1e6, words.nbytes * 8 / flat.size


def per_run_ans(runs: list[tuple[np.ndarray, np.ndarray]], repeats: int) -> tuple[float, float, float]:
    """runs: (symbols int32, frequency table) coded each with its own model, one ANS stream."""
    n = sum(len(s) for s, _ in runs)
    models = [Cat(f.astype(np.float64), perfect=False) for _, f in runs]

    def encode() -> np.ndarray:
        c = Ans()
        for (sym, _), m in zip(reversed(runs), reversed(models)):
            c.encode_reverse(sym, m)
        return c.get_compressed()
    t_enc = best(encode, repeats)
    words = encode()

    def decode() -> None:
        c = Ans(words)
        for (sym, _), m in zip(runs, models):
            c.decode(m, len(sym))
    t_dec = best(decode, repeats)
    return n / t_enc / 1e6, n / t_dec / 1e6, words.nbytes * 8 / n


def cachegen_path(tables: SymbolTables, repeats: int) -> tuple[float, float, float]:
    layout, symbols = tables.layout, tables.symbols
    models = coder.build_models(layout, tables.freqs)
    pairs = range(len(layout.groups))

    def encode() -> list[np.ndarray]:
        return [coder.encode_substream(symbols[g], layout.groups[g], models) for g in pairs]
    streams = encode()
    out = np.empty_like(symbols)

    def decode() -> None:
        for g in pairs:
            coder.decode_substream(streams[g], layout.groups[g], models, out[g])
    t_enc, t_dec = best(encode, repeats), best(decode, repeats)
    assert np.array_equal(out, symbols)
    n = symbols.size
    return n / t_enc / 1e6, n / t_dec / 1e6, sum(s.nbytes for s in streams) * 8 / n


def measure_chunk(chunk: torch.Tensor, cfg: CacheGenConfig, repeats: int
                  ) -> dict[str, tuple[float, float, float]]:
    impl = CacheGenEncoderImpl(fp_k=chunk[0], fp_v=chunk[1], key_bins=cfg.key_bins(),
                               value_bins=cfg.value_bins())
    impl.quantize()
    tables = impl.compute_cdf()
    layout, symbols = tables.layout, tables.symbols  # [2L, C, T] class-sorted, offset
    groups = [(g, grp) for g, pg in enumerate(layout.groups) for grp in pg]
    # 1: per-symbol models on the first 4 pairs, symbols re-based to one alphabet
    low = np.array([[grp.low for grp in layout.groups[g] for _ in range(grp.row_end - grp.row_start)]
                    for g in range(4)])
    plain = symbols[:4] + low[:, :, None]
    plain -= plain.min()
    results = {"range coder, model per symbol (4 pairs)":
               per_symbol_range(plain, int(plain.max()) + 1, repeats)}
    # 2: one model per (pair, channel) run
    runs = []
    for g, grp in groups:
        for r in range(grp.row_start, grp.row_end):
            sym = np.ascontiguousarray(symbols[g, r])
            runs.append((sym, np.bincount(sym, minlength=grp.size)))
    results["ANS, model per (layer, channel) run"] = per_run_ans(runs, repeats)
    # 3: one model per group
    runs = [(np.ascontiguousarray(symbols[g, grp.row_start:grp.row_end].reshape(-1)),
             tables.freqs[grp.freq_start:grp.freq_start + grp.size]) for g, grp in groups]
    results["ANS, model per (pair, class) group"] = per_run_ans(runs, repeats)
    # 4: CacheGen's path
    results["ANS, group + tuples (CacheGen)"] = cachegen_path(tables, repeats)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = KVModel()
    prompt = model.prompt(EVAL_TEXTS[0], 256 * args.chunks, 1)
    kv = model.kv_of(prompt.context).to(torch.bfloat16)
    cfg = CacheGenConfig.from_model_name("SmolLM2-135M", model.num_layers)
    totals: dict[str, list[tuple[float, float, float]]] = {}
    for t0 in range(0, kv.shape[2], 256):
        for name, vals in measure_chunk(kv[:, :, t0:t0 + 256], cfg, args.repeats).items():
            totals.setdefault(name, []).append(vals)
    print(f"{'way':44s} {'enc Mval/s':>10s} {'dec Mval/s':>10s} {'dec MB/s':>9s} {'bits/val':>8s}")
    rows = []
    for name, vals in totals.items():
        enc, dec, bits = (float(np.mean([v[i] for v in vals])) for i in range(3))
        rows.append({"way": name, "encode_Mvalues_per_s": enc, "decode_Mvalues_per_s": dec,
                     "decode_MBps_bf16": 2 * dec, "payload_bits_per_value": bits})
        shown = f"{bits:8.3f}" if "4 pairs" not in name else f"{'(other)':>8s}"
        print(f"{name:44s} {enc:10.1f} {dec:10.1f} {2 * dec:9.0f} {shown}")
    OUT.mkdir(exist_ok=True)
    (OUT / "cachegen_coder_speed.json").write_text(json.dumps(
        {"chunks": args.chunks, "repeats": args.repeats, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
