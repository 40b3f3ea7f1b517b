"""What vLLM KV events cost the worker on a store: `LMCacheEngine.store` of a `--tokens` prompt
with events off against the same store with the worker's event work around it (recording the
chunks' vLLM blocks before it, taking the tiers' events as vLLM's `BlockStored` / `BlockRemoved`
after it), as the connector does every step.

Two engines with SmolLM2-135M's KV shape (fp32, vLLM v1 paged cache, chunk 256, vLLM blocks of
`--block-size`) store the same tokens; each empties its hot tier before each store (so every store
is cold, and the events engine also translates the previous clear's removals). Rounds alternate
which engine goes first. The figure is the ratio of the median store times (events / no events),
and the median time of the event work alone.

    python benchmarks/kv_events_overhead.py [--tokens 4096] [--block-size 128] [--reps 30]

Prints a table, writes benchmarks/out/kv_events_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from engine_throughput import build_engine, caches
from machine import cpu_line

from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2

OUT = Path(__file__).parent / "out"
LAYERS, HEADS, HEAD_SIZE = 30, 3, 64  # SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    from lmcache.integration.vllm.kv_events import PlanBlocks, WorkerEvents

    n, bs, dtype = args.tokens, args.block_size, torch.float32
    nbytes = 2 * LAYERS * n * HEADS * HEAD_SIZE * dtype.itemsize
    num_blocks = n // bs
    src = caches((2, num_blocks, bs, HEADS, HEAD_SIZE), LAYERS, True, dtype)
    slots = torch.arange(n)
    tokens = torch.randint(0, 49152, (n,))
    token_ids = tokens.tolist()
    blocks = PlanBlocks([i.to_bytes(32, "big") for i in range(n // bs)], bs)
    plain, with_events = (build_engine(LAYERS, HEADS, HEAD_SIZE, nbytes, dtype,
                                       VLLMPagedMemGPUConnectorV2(HEADS * HEAD_SIZE, LAYERS))
                          for _ in range(2))
    events = WorkerEvents(with_events)
    times: dict[str, list[float]] = {"off": [], "on": [], "event work": []}
    published = 0

    def store_plain() -> None:
        plain.storage_manager.clear("hot")
        t0 = time.perf_counter()
        plain.store(tokens, kvcaches=src, slot_mapping=slots)
        times["off"].append(time.perf_counter() - t0)

    def store_with_events() -> None:
        nonlocal published
        with_events.storage_manager.clear("hot")
        t0 = time.perf_counter()
        events.record(token_ids, None, blocks, 0)
        t1 = time.perf_counter()
        with_events.store(tokens, kvcaches=src, slot_mapping=slots)
        t2 = time.perf_counter()
        got = events.take()
        t3 = time.perf_counter()
        published += len(got.get_all_events()) if got is not None else 0
        times["on"].append(t3 - t0)
        times["event work"].append((t1 - t0) + (t3 - t2))

    store_plain(), store_with_events()  # the arenas grow to the request's size: not measured
    for v in times.values():
        v.clear()
    for rep in range(args.reps):
        for run in ((store_plain, store_with_events) if rep % 2 == 0 else (store_with_events, store_plain)):
            run()
    plain.close(), with_events.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"cpu": cpu_line(), "tokens": n, "block_size": bs, "reps": args.reps, "bytes": nbytes,
              "median_s": med, "ratio_on_off": med["on"] / med["off"], "events_published": published}
    print(f"{cpu_line()}; {n} tokens fp32 SmolLM2 KV ({nbytes / 1e6:.0f} MB), vLLM blocks of {bs}, "
          f"{args.reps} rounds")
    print("| store | median s |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.4f} |")
    print(f"ratio of medians (events on / off): {result['ratio_on_off']:.3f}; events published: {published}")
    OUT.mkdir(exist_ok=True)
    (OUT / "kv_events_overhead.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
