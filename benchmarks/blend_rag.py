"""CacheBlend on RAG-shaped inputs: TTFT and quality versus full prefill, per recompute ratio.

Input per question: six ~400-token passages of 19th-century prose (benchmarks/data/blend_passages,
in a different order for every question), each followed by the separator
(``blend_special_str``), then the question. Every passage's KV is precomputed alone (positions
from 0) and stored through the engine once. For each recompute ratio the input is prefilled with
`CacheBlendLM` (retrieval of every passage's KV + blended forward) and compared with a full
prefill of the same tokens measured in the same run:

- TTFT: wall time from token ids to next-token logits (median of `--repeats`), and its ratio to
  full prefill's;
- quality: the reference answer is teacher-forced after the question from each prefill's KV
  cache; over its tokens, the mean KL(full || blend) of the next-token distributions and the top-1
  agreement; extra: agreement of `--greedy` free-running greedy tokens (unstable on a 135M model).

Goals at ratio 0.15: TTFT <= 0.35x full prefill, KL <= half of ratio 0's.
Writes a table, benchmarks/out/blend_rag.json and benchmarks/out/blend_rag.png.

    python benchmarks/blend_rag.py [--questions 6] [--repeats 2] [--ratios 0,0.05,0.15,0.3,1.0]
                                   [--check-layers 1]   (e.g. 1,4 for gradual filtering)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from lmcache.cache_engine import LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.local_model import local_model_path
from lmcache.integration.transformers import CacheBlendLM, create_hf_engine

DATA = Path(__file__).parent / "data" / "blend_passages"
OUT = Path(__file__).parent / "out"
GOAL_TTFT, GOAL_KL_FRACTION, GOAL_RATIO = 0.35, 0.5, 0.15


@dataclasses.dataclass
class Prefill:
    logits: torch.Tensor  # [vocab]
    cache: DynamicCache
    recomputed: int


def timed(fn: Callable[[], Prefill], repeats: int) -> tuple[Prefill, list[float]]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    assert out is not None
    return out, times


@torch.inference_mode()
def teacher_forced_logprobs(model: Any, pre: Prefill, answer: torch.Tensor) -> torch.Tensor:
    """``[len(answer), vocab]`` log-probs predicting each answer token; the cache is restored."""
    n = answer.numel()
    rest = model(input_ids=answer[:-1].unsqueeze(0), past_key_values=pre.cache, use_cache=True).logits[0]
    pre.cache.crop(-(n - 1))
    return torch.log_softmax(torch.cat([pre.logits.unsqueeze(0), rest]).float(), dim=-1)


@torch.inference_mode()
def greedy_tokens(model: Any, pre: Prefill, steps: int) -> list[int]:
    tokens = [int(pre.logits.argmax())]
    for _ in range(steps - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=pre.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    pre.cache.crop(-(steps - 1))
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratios", default="0,0.05,0.15,0.3,1.0")
    ap.add_argument("--questions", type=int, default=6, help="how many of the 6 questions to run")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per prefill (median reported)")
    ap.add_argument("--greedy", type=int, default=12, help="free-running greedy tokens compared")
    ap.add_argument("--check-layers", default="1",
                    help="comma-separated CacheBlend check layers (the config default is 1)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    started = time.perf_counter()

    path = local_model_path(args.dtype)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    passages = {p.name: p.read_text(encoding="utf-8").strip() for p in sorted(DATA.glob("*.txt"))}
    questions = json.loads((DATA / "questions.json").read_text(encoding="utf-8"))[: args.questions]

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, max_local_cpu_size=1.0, enable_blending=True, blend_min_tokens=0,
        blend_check_layers=[int(x) for x in args.check_layers.split(",")])
    engine = create_hf_engine(model, config, instance_id="blend_rag")
    blenders = {r: CacheBlendLM(model, engine, tokenizer=tok,
                                config=dataclasses.replace(config, blend_recompute_ratio=r)) for r in ratios}
    any_blender = blenders[ratios[0]]

    t0 = time.perf_counter()
    seg_tokens = {name: any_blender.encode_segment(text) for name, text in passages.items()}
    computed = sum(any_blender.precompute(ids) for ids in seg_tokens.values())
    precompute_s = time.perf_counter() - t0
    print(f"precomputed {len(seg_tokens)} passages ({computed} tokens, "
          f"{[t.numel() for t in seg_tokens.values()]}) in {precompute_s:.1f}s")

    def full_prefill(ids: torch.Tensor) -> Prefill:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model(input_ids=ids.unsqueeze(0), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return Prefill(out.logits[0, -1], cache, ids.numel())

    def blend_prefill(blender: CacheBlendLM, ids: torch.Tensor) -> Prefill:
        out = blender.prefill(ids)
        return Prefill(out.logits, out.past_key_values, out.num_recomputed_tokens)

    names = list(passages)
    records: list[dict[str, Any]] = []
    for qi, q in enumerate(questions):
        order = names[:]
        random.Random(qi).shuffle(order)
        ids = any_blender.build_input([passages[n] for n in order], f"\nQuestion: {q['question']}\nAnswer:")
        answer = torch.tensor(tok(q["answer"], add_special_tokens=False)["input_ids"])
        if qi == 0:  # warm-up: allocator, thread pools, kernels
            full_prefill(ids)
            blend_prefill(blenders[ratios[0]], ids)
        full, full_times = timed(lambda ids=ids: full_prefill(ids), args.repeats)
        ref = teacher_forced_logprobs(model, full, answer)
        ref_greedy = greedy_tokens(model, full, args.greedy)
        for r in ratios:
            pre, times = timed(lambda r=r, ids=ids: blend_prefill(blenders[r], ids), args.repeats)
            lp = teacher_forced_logprobs(model, pre, answer)
            kl = (ref.exp() * (ref - lp)).sum(-1)
            greedy = greedy_tokens(model, pre, args.greedy)
            records.append({
                "question": qi, "order": order, "num_tokens": ids.numel(), "answer_tokens": answer.numel(),
                "ratio": r, "recomputed_tokens": pre.recomputed,
                "full_ttft_s": statistics.median(full_times), "blend_ttft_s": statistics.median(times),
                "full_times": full_times, "blend_times": times,
                "kl_mean": float(kl.mean()), "kl_first_token": float(kl[0]),
                "top1_agreement": float((lp.argmax(-1) == ref.argmax(-1)).float().mean()),
                "greedy_agreement": sum(a == b for a, b in zip(greedy, ref_greedy)) / args.greedy,
            })
        print(f"question {qi + 1}/{len(questions)} done ({ids.numel()} tokens, "
              f"full prefill {statistics.median(full_times):.2f}s)")

    summary = summarize(records, ratios)
    print_table(summary)
    goals = check_goals(summary)
    result = {
        "model": path, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "check_layers": config.blend_check_layers, "repeats": args.repeats, "questions": len(questions),
        "precompute_s": precompute_s, "total_s": time.perf_counter() - started,
        "summary": summary, "goals": goals, "records": records,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    layers_tag = "-".join(str(x) for x in config.blend_check_layers)
    stem = "blend_rag" if layers_tag == "1" else f"blend_rag_check{layers_tag}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(summary, out_dir / f"{stem}.png", config.blend_check_layers)
    print(f"wrote {out_dir / stem}.json and .png (total {result['total_s']:.0f}s)")
    for blender in blenders.values():
        blender.close()
    LMCacheEngineBuilder.destroy("blend_rag")


def summarize(records: list[dict[str, Any]], ratios: list[float]) -> list[dict[str, float]]:
    rows = []
    for r in ratios:
        rs = [x for x in records if x["ratio"] == r]
        mean = lambda key, rs=rs: statistics.fmean(x[key] for x in rs)  # noqa: E731
        rows.append({
            "ratio": r, "ttft_s": mean("blend_ttft_s"), "full_ttft_s": mean("full_ttft_s"),
            "ttft_vs_full": statistics.fmean(x["blend_ttft_s"] / x["full_ttft_s"] for x in rs),
            "recomputed_fraction": statistics.fmean(x["recomputed_tokens"] / x["num_tokens"] for x in rs),
            "kl_mean": mean("kl_mean"), "kl_first_token": mean("kl_first_token"),
            "top1_agreement": mean("top1_agreement"), "greedy_agreement": mean("greedy_agreement"),
        })
    return rows


def print_table(rows: list[dict[str, float]]) -> None:
    print(f"\n{'ratio':>6} {'TTFT s':>8} {'full s':>8} {'vs full':>8} {'recomp':>7} {'KL':>8} "
          f"{'KL tok0':>8} {'top-1':>6} {'greedy':>7}")
    for x in rows:
        print(f"{x['ratio']:>6.2f} {x['ttft_s']:>8.3f} {x['full_ttft_s']:>8.3f} {x['ttft_vs_full']:>7.3f}x "
              f"{x['recomputed_fraction']:>7.3f} {x['kl_mean']:>8.4f} {x['kl_first_token']:>8.4f} "
              f"{x['top1_agreement']:>6.3f} {x['greedy_agreement']:>7.3f}")


def check_goals(rows: list[dict[str, float]]) -> dict[str, Any]:
    by_ratio = {x["ratio"]: x for x in rows}
    if GOAL_RATIO not in by_ratio or 0.0 not in by_ratio:
        return {}
    at, zero = by_ratio[GOAL_RATIO], by_ratio[0.0]
    goals = {
        "ttft_vs_full": at["ttft_vs_full"], "ttft_goal": GOAL_TTFT,
        "ttft_met": at["ttft_vs_full"] <= GOAL_TTFT,
        "kl": at["kl_mean"], "kl_ratio0": zero["kl_mean"], "kl_goal": GOAL_KL_FRACTION * zero["kl_mean"],
        "kl_met": at["kl_mean"] <= GOAL_KL_FRACTION * zero["kl_mean"],
    }
    print(f"\ngoal at ratio {GOAL_RATIO}: TTFT {at['ttft_vs_full']:.3f}x full (<= {GOAL_TTFT}) "
          f"{'MET' if goals['ttft_met'] else 'MISSED'}; KL {at['kl_mean']:.4f} vs ratio 0's "
          f"{zero['kl_mean']:.4f} (<= {goals['kl_goal']:.4f}) {'MET' if goals['kl_met'] else 'MISSED'}")
    return goals


def plot(rows: list[dict[str, float]], path: Path, check_layers: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = [x["ratio"] for x in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(r, [x["ttft_vs_full"] for x in rows], "o-", label="CacheBlend")
    a.axhline(1.0, color="gray", ls="--", label="full prefill")
    a.axhline(GOAL_TTFT, color="red", ls=":", label=f"goal {GOAL_TTFT}x")
    a.set(xlabel="recompute ratio", ylabel="TTFT / full prefill", title="Time to first token")
    a.legend()
    b.plot(r, [x["kl_mean"] for x in rows], "o-", label="KL(full || blend)")
    b.set(xlabel="recompute ratio", ylabel="mean KL (nats)", title="Quality vs full prefill")
    b2 = b.twinx()
    b2.plot(r, [x["top1_agreement"] for x in rows], "s--", color="green", label="top-1 agreement")
    b2.set_ylim(0, 1.05)
    b2.set_ylabel("top-1 agreement")
    handles = b.get_legend_handles_labels()[0] + b2.get_legend_handles_labels()[0]
    b.legend(handles, [h.get_label() for h in handles], loc="center right")
    fig.suptitle(f"CacheBlend, check layers {check_layers}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
