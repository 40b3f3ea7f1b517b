"""How much does CacheGen shrink a KV cache, at what quality, on text of every genre? (issues 6, 12)

For each evaluation text (ten texts of six genres: prose, dialogue, code, legal/technical,
non-English, numbers/tables; `cachegen_common.EVAL`, none used for fitting), SmolLM2-135M (fp32)
computes the KV of a 1,800-token context; the KV is cast to bf16 (what the cache holds) and
compressed chunk by chunk (256 tokens; the trailing partial chunk too) by each codec, then the
next 256 tokens are teacher-forced on top of the decoded KV. Reported per codec:

- bits/value and bytes/token counting every stored byte (for CacheGen the whole blob: header,
  tables, scales, means, anchor bits; for bf16 / int8 the raw data plus the same 88-byte header);
- KL(p_ref || p) of the next-token distribution (p_ref uses the fp32 KV): the mean over each
  text's positions, then the largest over texts (the goal: <= 0.01 on every genre) and the mean
  over all positions; top-1 agreement;
- encode / decode MB/s of bf16 input bytes (best of --repeats per chunk, summed over chunks;
  `cachegen_coder_speed.py` measures speed properly).

Codecs: bf16 (the uncompressed cache), an 8-bit per-token baseline (`torch_quant_vectorized`
with 255 levels + a bf16 scale per token), CacheGen at several `cachegen_quality` settings (the
fitted SmolLM2 table scaled; 1.0 is the default) and the layer-count default for unknown models,
and per-token max quantization at 32 / 64 levels counted at its ideal entropy (one histogram per
layer and chunk, no side info; not a real codec, so no speed).

Writes benchmarks/out/cachegen_quality.{json,png}. Default run: ~6 minutes on 2 idle cores.
    PYTHONPATH=. python benchmarks/cachegen_quality.py [--contexts 10] [--threads 2] [--greedy 32]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from cachegen_common import EVAL, EVAL_TEXTS, KVModel, kl_and_top1

from lmcache.cachegen.config import CacheGenConfig
from lmcache.cachegen.serde import CacheGenDeserializer, CacheGenSerializer
from lmcache.compat.cachegen_seed import do_dequantize, torch_quant_vectorized
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.storage_backend.serde.blob import HEADER_SIZE

OUT = Path(__file__).with_name("out")
CHUNK = 256
QUALITIES = (0.6, 0.8, 1.0, 1.25, 1.6, 2.0)


@dataclass
class Codec:
    name: str
    to_bytes: Callable[[torch.Tensor], bytes] | None  # None: size is an entropy estimate
    from_bytes: Callable[[bytes], torch.Tensor] | None
    estimate: Callable[[torch.Tensor], tuple[torch.Tensor, float]] | None = None
    kind: str = "cachegen"
    stats: dict = field(default_factory=lambda: {"bytes": 0.0, "values": 0, "tokens": 0,
                                                 "enc_s": 0.0, "dec_s": 0.0, "kl": [],
                                                 "top1": [], "greedy": []})


def raw_codec(dtype: torch.dtype) -> Codec:
    def enc(kv: torch.Tensor) -> bytes:
        return kv.contiguous().view(torch.int16).numpy().tobytes()

    def dec(bs: bytes) -> torch.Tensor:  # flat; the caller restores the shape
        return torch.frombuffer(bytearray(bs), dtype=torch.int16).view(dtype)
    return Codec("bf16 (uncompressed cache)", enc, dec, kind="bf16")


def int8_codec() -> Codec:
    """Per-token int8: 255 levels scaled by each token's max |value| (bf16 scale stored)."""
    bins = None

    def enc(kv: torch.Tensor) -> bytes:
        nonlocal bins
        two, nl, nt, nc = kv.shape
        bins = torch.full((two * nl,), 255)
        q, maxes = torch_quant_vectorized(bins, kv.reshape(two * nl, nt, nc))
        head = np.array([two, nl, nt, nc], dtype=np.int32).tobytes()
        return head + q.to(torch.int8).numpy().tobytes() + \
            maxes.to(torch.bfloat16).view(torch.int16).numpy().tobytes()

    def dec(bs: bytes) -> torch.Tensor:
        two, nl, nt, nc = np.frombuffer(bs, dtype=np.int32, count=4).tolist()
        n = two * nl * nt * nc
        q = torch.from_numpy(np.frombuffer(bs, dtype=np.int8, count=n, offset=16).copy())
        maxes = torch.from_numpy(np.frombuffer(bs, dtype=np.int16, offset=16 + n).copy())
        x = do_dequantize(q.view(two * nl, nt, nc), torch.full((two * nl,), 255),
                          maxes.view(torch.bfloat16).float().view(two * nl, nt, 1))
        return x.to(torch.bfloat16).view(two, nl, nt, nc)
    return Codec("int8 per-token (baseline)", enc, dec, kind="baseline")


def entropy_reference(levels: int) -> Codec:
    def estimate(kv: torch.Tensor) -> tuple[torch.Tensor, float]:
        two, nl, nt, nc = kv.shape
        bins = torch.full((two * nl,), levels)
        q, maxes = torch_quant_vectorized(bins, kv.reshape(two * nl, nt, nc).float())
        bits = 0.0
        for pair in q:
            _, counts = torch.unique(pair, return_counts=True)
            p = counts.double() / counts.sum()
            bits -= float((p * p.log2()).sum()) * pair.numel()
        return do_dequantize(q, bins, maxes).to(kv.dtype).view(kv.shape), bits / 8
    return Codec(f"per-token max, {levels} levels (entropy only)", None, None, estimate,
                 kind="reference")


def cachegen_codec(name: str, cfg: LMCacheEngineConfig, md: LMCacheEngineMetadata,
                   cgc: CacheGenConfig | None = None) -> Codec:
    ser = CacheGenSerializer(cfg, md, cachegen_config=cgc)
    de = CacheGenDeserializer(cfg, md, md.kv_dtype)
    return Codec(name, ser.to_bytes, de.from_bytes)


def run_codec(codec: Codec, kv: torch.Tensor, repeats: int) -> torch.Tensor:
    """Compress kv [2, L, T, C] chunk by chunk; returns the decoded KV and updates stats."""
    out, st = [], codec.stats
    for t0 in range(0, kv.shape[2], CHUNK):
        chunk = kv[:, :, t0:t0 + CHUNK].contiguous()
        if codec.estimate is not None:
            decoded, nbytes = codec.estimate(chunk)
        else:
            assert codec.to_bytes is not None and codec.from_bytes is not None
            enc_t, dec_t = [], []
            for _ in range(repeats):
                t = time.perf_counter()
                bs = codec.to_bytes(chunk)
                enc_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                decoded = codec.from_bytes(bs)
                dec_t.append(time.perf_counter() - t)
            nbytes = len(bs) + HEADER_SIZE * (codec.kind != "cachegen")
            st["enc_s"] += min(enc_t)
            st["dec_s"] += min(dec_t)
        st["bytes"] += nbytes
        st["values"] += chunk.numel()
        st["tokens"] += chunk.shape[2]
        out.append(decoded.view(chunk.shape))
    return torch.cat(out, dim=2)


def summarize(codec: Codec) -> dict:
    st = codec.stats
    mb = st["values"] * 2 / 1e6
    per_text = [float(k.mean()) for k in st["kl"]]
    return {
        "codec": codec.name, "kind": codec.kind,
        "bits_per_value": 8 * st["bytes"] / st["values"],
        "bytes_per_token": st["bytes"] / st["tokens"],
        "mean_kl": float(torch.cat(st["kl"]).mean()),
        "max_text_kl": max(per_text),
        "mean_kl_per_text": per_text,
        "top1_agreement": float(torch.cat(st["top1"]).mean()),
        "encode_MBps": mb / st["enc_s"] if st["enc_s"] else None,
        "decode_MBps": mb / st["dec_s"] if st["dec_s"] else None,
        "greedy_agreement": float(np.mean(st["greedy"])) if st["greedy"] else None,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {"cachegen": ("o-", "tab:blue", "CacheGen, cachegen_quality settings"),
              "reference": ("s--", "tab:gray", "per-token max quantization (entropy only)"),
              "baseline": ("D", "tab:red", "int8 per-token baseline"),
              "bf16": ("^", "black", "bf16 cache")}
    for kind, (marker, color, label) in styles.items():
        pts = sorted((r["bits_per_value"], max(r["max_text_kl"], 1e-7), r["codec"]) for r in rows
                     if r["kind"] == kind)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, color=color, label=label + " (worst text)")
        if kind == "cachegen":
            mean = sorted((r["bits_per_value"], r["mean_kl"]) for r in rows if r["kind"] == kind)
            ax.plot([p[0] for p in mean], [p[1] for p in mean], "o:", color=color, alpha=0.5,
                    label="CacheGen (mean over texts)")
            for x, y, name in pts:
                ax.annotate(name.split("=")[-1].rstrip(")"), (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
    for r in rows:
        if r["kind"] == "default_for_layers":
            ax.plot(r["bits_per_value"], r["max_text_kl"], "x", color="tab:green",
                    label="CacheGen, layer-count default (worst text)")
    ax.axhline(0.01, color="tab:orange", lw=0.8, ls=":")
    ax.axvline(3.0, color="tab:orange", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("bits per value (every stored byte)")
    ax.set_ylabel("KL of next-token distribution (nats)")
    ax.set_title("SmolLM2-135M KV, 10 texts / 6 genres: size vs quality (goal: worst <= 0.01 at <= 3 bits)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, default=len(EVAL_TEXTS))
    ap.add_argument("--ctx-tokens", type=int, default=1800)
    ap.add_argument("--next-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="timing repeats per chunk (best kept)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--greedy", type=int, default=0, help="extra: greedy tokens to compare")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = KVModel()
    md = LMCacheEngineMetadata("SmolLM2-135M-Instruct", 1, 0, "huggingface", torch.bfloat16,
                               (model.num_layers, 2, CHUNK, model.kv_heads, model.head_dim))
    codecs = [raw_codec(torch.bfloat16), int8_codec(), entropy_reference(32), entropy_reference(64)]
    for q in QUALITIES:  # what users set: LMCacheEngineConfig.cachegen_quality
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, cachegen_quality=q)
        codecs.append(cachegen_codec(f"cachegen (cachegen_quality={q:g})", cfg, md))
    unknown = cachegen_codec(f"cachegen, default for {model.num_layers} layers (unknown model)",
                             LMCacheEngineConfig.from_defaults(chunk_size=CHUNK), md,
                             CacheGenConfig.default_for_layers(model.num_layers))
    unknown.kind = "default_for_layers"
    codecs.append(unknown)

    t_start = time.time()
    texts = EVAL[: args.contexts]
    for _, text in texts:
        prompt = model.prompt(text, args.ctx_tokens, args.next_tokens)
        kv32 = model.kv_of(prompt.context)
        ref = model.next_logprobs(kv32, prompt.continuation)
        ref_greedy = model.greedy(kv32, prompt.continuation[:1], args.greedy) if args.greedy else []
        kv = kv32.to(torch.bfloat16)
        for codec in codecs:
            decoded = run_codec(codec, kv, args.repeats)
            kl, top1 = kl_and_top1(ref, model.next_logprobs(decoded, prompt.continuation))
            codec.stats["kl"].append(kl)
            codec.stats["top1"].append(top1)
            if args.greedy:
                got = model.greedy(decoded, prompt.continuation[:1], args.greedy)
                codec.stats["greedy"].append(np.mean([a == b for a, b in zip(got, ref_greedy)]))
        print(f"{prompt.name}: done ({time.time() - t_start:.0f} s)", flush=True)

    rows = [summarize(c) for c in codecs]
    base = next(r for r in rows if r["kind"] == "baseline")
    print(f"\n{'codec':52s} {'bits/val':>8s} {'vs int8':>7s} {'worst KL':>9s} {'mean KL':>9s} "
          f"{'top-1':>6s} {'enc MB/s':>9s} {'dec MB/s':>9s}" + ("  greedy" if args.greedy else ""))
    for r in rows:
        def speed(v: float | None) -> str:
            return f"{v:9.0f}" if v else f"{'-':>9s}"
        ratio = base["bits_per_value"] / r["bits_per_value"]
        print(f"{r['codec']:52s} {r['bits_per_value']:8.3f} {ratio:6.2f}x {r['max_text_kl']:9.5f} "
              f"{r['mean_kl']:9.5f} {r['top1_agreement']:6.3f} "
              f"{speed(r['encode_MBps'])} {speed(r['decode_MBps'])}"
              + (f"  {r['greedy_agreement']:.3f}" if args.greedy else ""))
    default = next(r for r in rows if r["codec"] == "cachegen (cachegen_quality=1)")
    print("\nper text, KL of the default (cachegen_quality=1):")
    for (genre, text), kl in zip(texts, default["mean_kl_per_text"]):
        print(f"  {genre:16s} {Path(text).name:44s} {kl:.5f}")
    goals = {
        "worst_text_kl_le_0.01": default["max_text_kl"] <= 0.01,
        "bits_le_3.0": default["bits_per_value"] <= 3.0,
        "ratio_vs_int8": base["bits_per_value"] / default["bits_per_value"],
    }
    print(f"\ndefault CacheGen: {default['bits_per_value']:.3f} bits/value, worst-text KL "
          f"{default['max_text_kl']:.4f}, mean KL {default['mean_kl']:.4f}; goals: "
          + ", ".join(f"{k}={v if isinstance(v, bool) else round(v, 2)}" for k, v in goals.items()))
    OUT.mkdir(exist_ok=True)
    result = {
        "setup": {"model": md.model_name, "texts": [list(t) for t in texts],
                  "ctx_tokens": args.ctx_tokens, "next_tokens": args.next_tokens,
                  "chunk": CHUNK, "kv_dtype": "bfloat16", "reference": "fp32 KV",
                  "torch_threads": torch.get_num_threads(), "repeats": args.repeats,
                  "seconds": round(time.time() - t_start, 1)},
        "rows": rows, "goals": goals,
    }
    (OUT / "cachegen_quality.json").write_text(json.dumps(result, indent=2))
    plot(rows, OUT / "cachegen_quality.png")
    print(f"wrote {OUT / 'cachegen_quality.json'} and cachegen_quality.png")


if __name__ == "__main__":
    main()
