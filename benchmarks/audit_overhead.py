"""What self-verification costs the demo's repeats: repeat TTFT of the long-document QA job
(`long_doc_qa.py`'s model and documents) with ``verify_rate`` 0.01 against 0, in the same run.

Two engines with LMCache (hot CPU tier) run side by side in this process, identical but for
``lmcache.verify_rate``. Each document is prefilled once in each (stored), then every round asks
every document once of each engine, interleaved (the engine asked first alternates), with vLLM's
own prefix cache reset before each request, so each repeat is served by LMCache, or, for an audited
lookup (1 in 100 at rate 0.01, the 100th first), computed cold and its KV compared in the
background. TTFT is the wall time of a one-token request (vLLM's own per-request metrics need its
stats logging, which two engines with a connector in one process cannot have: both would register
LMCache's Prometheus metrics). The figure is the ratio of the medians of the repeat TTFTs (audited requests
included: they are the cost); the goal is at most 1.02.

    python benchmarks/audit_overhead.py [--num-docs 2] [--doc-tokens 2000] [--rounds 100]

Prints a table and the goal with `met` / `NOT met`, writes benchmarks/out/audit_overhead.json, and
exits with status 1 when the goal is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from long_doc_qa import attention_isa, build_documents, engine_kernels, kernels_line
from machine import cpu_line, pick_dtype

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

OUT = Path(__file__).parent / "out"
RATES = (0.0, 0.01)
GOAL = 1.02


def start(rate: float, model: str, args: argparse.Namespace) -> Any:
    from vllm import LLM

    engine_id = f"audit-overhead-{os.getpid()}-{rate}"
    transfer = {"kv_connector": "LMCacheConnectorV1", "kv_connector_module_path": "lmcache.integration.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "engine_id": engine_id,
                "kv_connector_extra_config": {"lmcache.max_local_cpu_size": 2.0,
                                              "lmcache.verify_rate": rate}}
    # stats logging off: two engines with a connector in one process would register LMCache's
    # Prometheus metrics twice
    llm = LLM(model=model, dtype=args.dtype, enforce_eager=True, max_model_len=args.doc_tokens + 256,
              kv_cache_memory_bytes=int(args.kv_gb * (1 << 30)), disable_log_stats=True,
              kv_transfer_config=transfer)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-docs", type=int, default=2)
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--kv-gb", type=float, default=1.0, help="vLLM's KV pool of each engine (GiB)")
    args = parser.parse_args()
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcache.integration.local_model import local_model_path
    from lmcache.integration.vllm.lookup_channel import LookupClient, socket_path

    args.dtype, why = pick_dtype(args.dtype)
    model = local_model_path(args.dtype)
    docs = build_documents(AutoTokenizer.from_pretrained(model), args.num_docs, args.doc_tokens)
    engines = {rate: start(rate, model, args) for rate in RATES}
    isa = attention_isa(engines[0.0])
    sampling = SamplingParams(max_tokens=1, temperature=0)
    ttft: dict[float, list[float]] = {rate: [] for rate in RATES}
    served: dict[float, list[int]] = {rate: [] for rate in RATES}
    first: dict[float, set[int]] = {rate: set() for rate in RATES}
    t0 = time.time()

    def ask(rate: float, ids: list[int]) -> tuple[float, int]:
        """(seconds to the first token: the wall time of a one-token request, tokens served)."""
        llm = engines[rate]
        llm.reset_prefix_cache()
        t = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling, use_tqdm=False)
        seconds = time.perf_counter() - t
        first[rate].add(out.outputs[0].token_ids[0])
        return seconds, int(out.num_cached_tokens or 0)

    for ids in docs:  # cold: stored in both
        for rate in RATES:
            ask(rate, ids)
    for rnd in range(args.rounds):
        for i, ids in enumerate(docs):
            order = RATES if (rnd + i) % 2 == 0 else RATES[::-1]
            for rate in order:
                seconds, hit = ask(rate, ids)
                ttft[rate].append(seconds)
                served[rate].append(hit)
    audits = {}
    for rate, llm in engines.items():
        client = LookupClient([socket_path(llm.llm_engine.vllm_config, 0)], timeout=10)
        (stats,) = client.stats()
        client.close()
        audits[rate] = (stats or {}).get("audits")
        llm.llm_engine.engine_core.shutdown()
    med = {rate: statistics.median(v) for rate, v in ttft.items()}
    ratio = med[0.01] / med[0.0]
    summary = {
        "machine": cpu_line(), "kernels": kernels_line(engine_kernels(), isa), "dtype": args.dtype,
        "dtype_why": why, "docs": args.num_docs, "doc_tokens": args.doc_tokens, "rounds": args.rounds,
        "wall_s": round(time.time() - t0, 1),
        "median_repeat_ttft_s": {str(r): round(m, 5) for r, m in med.items()},
        "mean_repeat_ttft_s": {str(r): round(statistics.fmean(v), 5) for r, v in ttft.items()},
        "audited_repeats": {str(r): sum(1 for s in served[r] if s == 0) for r in RATES},
        "ratio_of_medians": round(ratio, 4), "goal": GOAL, "met": ratio <= GOAL,
        "first_tokens_agree": first[0.0] == first[0.01], "audits": {str(r): a for r, a in audits.items()},
    }
    print(f"{summary['machine']}\n{summary['kernels']}; {args.dtype} ({why})")
    print(f"{args.num_docs} docs x {args.doc_tokens} tokens, {args.rounds} interleaved rounds")
    print("| verify_rate | median repeat TTFT | mean | repeats computed cold (audited) |")
    print("|---|---|---|---|")
    for r in RATES:
        print(f"| {r} | {med[r]:.4f} s | {statistics.fmean(ttft[r]):.4f} s | "
              f"{summary['audited_repeats'][str(r)]} of {len(ttft[r])} |")
    verdict = "met" if ratio <= GOAL else "NOT met"
    print(f"ratio of medians (0.01 / 0): {ratio:.4f}; goal <= {GOAL}: {verdict}")
    print(f"audits at 0.01: {json.dumps(audits[0.01])}")
    OUT.mkdir(exist_ok=True)
    (OUT / "audit_overhead.json").write_text(json.dumps(summary, indent=1))
    sys.exit(0 if ratio <= GOAL else 1)


if __name__ == "__main__":
    main()
