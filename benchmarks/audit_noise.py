"""How far a fresh prefill's KV is from the stored KV of the same prompt on this machine, per model
family and dtype: the measurement behind `integration.vllm.audit.ROUNDING_ULPS`.

For each family of `tests.helpers.tiny_models`, one engine with LMCache and ``verify_rate`` 1 (every
lookup that finds something is audited), prefill steps of 512 tokens, on this CPU's kernel build.
For each of a few prompts ``p`` of 1,281 tokens (stored in steps [0, 512), [512, 1024), [1024,
1281)), the audited requests compute the stored chunks again split otherwise:

- ``p[:800]``: its chunk [512, 768) computed in a step [512, 800);
- ``p[:200]`` then ``p`` (not for DeepSeek-V2, which vLLM-CPU runs without its prefix cache): vLLM's
  own prefix cache serves p's first block, the audited prefill starts at token 128;
- ``p`` again: the same split (must be exact).

The audits compare bit for bit, and otherwise in units in the last place of the dtype relative to
the layer's largest magnitude; the largest such difference of each family is the noise.

    python benchmarks/audit_noise.py [--archs llama,gemma3,...] [--prompts 3]

Prints a table, writes benchmarks/out/audit_noise.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_line

from lmcache.integration.vllm.cpu_build import describe
from tests.helpers.tiny_models import ARCHS, tiny_model_path
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text, start_llm, stop_llm

OUT = Path(__file__).parent / "out"
LENGTH = 1281
ENGINE_ARGS = {"qwen3_next": {"prefix_match_unit": 128}}


def measure(arch: str, prompts: int) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcache.integration.vllm.lookup_channel import LookupClient, socket_path

    model = tiny_model_path(arch)
    tok = AutoTokenizer.from_pretrained(model)
    transfer = lmcache_transfer_config(verify_rate=1.0, max_local_cpu_size=0.5)
    llm = start_llm(transfer, dtype=ARCHS[arch].dtype, model=model, max_num_batched_tokens=512,
                    **ENGINE_ARGS.get(arch, {}))
    sampling = SamplingParams(max_tokens=1, temperature=0)

    def run(ids: list[int], reset: bool = True) -> None:
        if reset:
            llm.reset_prefix_cache()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling, use_tqdm=False)

    client = LookupClient([socket_path(llm.llm_engine.vllm_config, 0)], timeout=10)
    try:
        for seed in range(prompts):
            p = tok(sentence_text(100 + seed, 1600), add_special_tokens=False).input_ids[:LENGTH]
            run(p)
            run(p[:800])
            if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:  # not MLA but on AMX
                run(p[:200])
                run(p, reset=False)
            run(p)
        deadline = time.monotonic() + 300
        while True:
            (stats,) = client.stats()
            assert stats is not None
            if stats["audits"]["queued_bytes"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        client.close()
        stop_llm(llm)
    audits = stats["audits"]
    totals: dict[str, int] = {}
    for kinds in audits["counts"].values():
        for results in kinds.values():
            for result, n in results.items():
                totals[result] = totals.get(result, 0) + n
    return {"arch": arch, "dtype": ARCHS[arch].dtype, "kernels": stats["kernels"], "counts": audits["counts"],
            "totals": totals, "largest_ulps": audits["largest_ulps"],
            "rounding_ulps": audits["rounding_ulps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--prompts", type=int, default=3)
    args = parser.parse_args()
    t0 = time.time()
    rows = [measure(arch, args.prompts) for arch in args.archs.split(",")]
    print(cpu_line())
    print(describe())
    print("| family | dtype | audits exact / within rounding / mismatch | largest difference (ulps) | "
          "tolerance (ulps) |")
    print("|---|---|---|---|---|")
    for r in rows:
        t = r["totals"]
        print(f"| {r['arch']} | {r['dtype']} | {t.get('exact', 0)} / {t.get('within_rounding', 0)} / "
              f"{t.get('mismatch', 0)} | {r['largest_ulps']:.3g} | {r['rounding_ulps']:g} |")
    OUT.mkdir(exist_ok=True)
    summary = {"machine": cpu_line(), "wall_s": round(time.time() - t0), "rows": rows}
    (OUT / "audit_noise.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
