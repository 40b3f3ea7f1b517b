"""Engine store/retrieve throughput through the CPU connectors vs. a plain copy of the same bytes.

For each case, a cache holds `--tokens` tokens in randomly placed blocks: a vLLM-v1-style paged
cache (per layer [2, num_blocks, block_size, heads, head_size], block `--block-size`) for each KV
shape, the seed API's per-layer (K, V) tuples (each [num_blocks, block_size, heads, head_size]) for
SmolLM2's shape, and vLLM-CPU's packed cache (per layer [num_blocks, heads, 128, 2 * head_size]) in every
layout vLLM-CPU writes on x86 (`PACKED`: vec and amx for bf16 SmolLM2-shaped KV, vec16 for an
80-wide head, vec for fp32), each probed with vLLM's own kernel where it runs here, else from its
closed form (the "layout from" column says which). Measured in one run:
- copy: `dst.copy_(src)` of two pre-faulted contiguous buffers of the same byte count (baseline);
- store (cold): `LMCacheEngine.store` of tokens the engine does not hold (hashing, allocation,
  connector gather, hot-tier insert), into an engine whose hot tier was emptied after the previous
  repetition: its arena has grown to the request's size (the first repetition, which grew it, is
  left out of the median);
- retrieve: `LMCacheEngine.retrieve` of all tokens back into a paged cache;
- new engine: the same store into a newly built engine, whose arena is touched a piece at a time as
  it fills (what an engine's first requests after start-up pay, once).
All are measured back to back in each of `--reps` repetitions, so machine drift hits them alike;
the table shows medians.
Prints GB/s and the ratio to the copy; writes JSON and a PNG under benchmarks/out/.

    python benchmarks/engine_throughput.py [--tokens 8192] [--block-size 16] [--no-native] [--no-packed]
        [--rows paged,tuples,vec,amx,vec16,vec-fp32]

The native copies take the widest vector path the CPU has (``LMCACHE_COPY_ISA`` caps it; the
table's header names the path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from machine import cpu_info, cpu_line

from lmcache import native
from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import GPUConnectorInterface, VLLMPagedMemGPUConnectorV2
from lmcache.memory_management import MixedMemoryAllocator
from lmcache.memory_management.allocators import GROW_BYTES
from lmcache.token_database import ChunkedTokenDatabase

SHAPES = {"SmolLM2-135M": (30, 3, 64), "7B-like": (32, 8, 128)}
PACKED_BLOCK = 128
# (isa, dtype, shape name, (layers, heads, head size)): every layout vLLM-CPU writes on x86
PACKED = {"vec": ("vec", torch.bfloat16, "SmolLM2-135M", SHAPES["SmolLM2-135M"]),
          "amx": ("amx", torch.bfloat16, "SmolLM2-135M", SHAPES["SmolLM2-135M"]),
          "vec16": ("vec16", torch.bfloat16, "80-wide heads", (30, 2, 80)),
          "vec-fp32": ("vec", torch.float32, "SmolLM2-135M", SHAPES["SmolLM2-135M"])}
ROWS = ("paged", "tuples", *PACKED)
OUT = Path(__file__).parent / "out"


@dataclass
class Row:
    shape: str
    layout: str
    layout_from: str
    dtype: str
    layers: int
    kv_heads: int
    head_size: int
    tokens: int
    block_size: int
    bytes: int
    copy_gbps: float
    store_cold_gbps: float
    retrieve_gbps: float
    store_ratio: float
    retrieve_ratio: float
    first_store_gbps: float  # the same store into a new engine, whose arena grows as it fills
    first_store_ratio: float


def caches(shape: tuple[int, ...], layers: int, fill: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    out = [torch.empty(shape, dtype=dtype) for _ in range(layers)]
    for c in out:  # touch every page so no measurement pays first-touch faults
        c.normal_() if fill else c.zero_()
    return out


def packed_layout(isa: str, dtype: torch.dtype, heads: int, head_size: int) -> tuple[Any, str]:
    """vLLM-CPU's packing of `isa` for this shape, and where it came from: probed with vLLM's own
    kernel where it runs here, else its closed form. Called before anything is measured: importing
    vLLM starts background work that would disturb the first measurements."""
    from lmcache.integration.vllm.cpu_layout import closed_form_layout, probe_packed_layout

    try:
        return probe_packed_layout(heads, head_size, PACKED_BLOCK, dtype, isa), "vLLM's kernel"
    except (ImportError, RuntimeError, AttributeError):
        return closed_form_layout(heads, head_size, PACKED_BLOCK, isa), "closed form"


def build_engine(layers: int, heads: int, head_size: int, nbytes: int, dtype: torch.dtype,
                 connector: GPUConnectorInterface) -> LMCacheEngine:
    chunk = 256
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk,
                                               max_local_cpu_size=nbytes * 1.05 / (1 << 30))
    metadata = LMCacheEngineMetadata("bench", 1, 0, "vllm", dtype,
                                     (layers, 2, chunk, heads, head_size))
    return LMCacheEngine(config, metadata, MixedMemoryAllocator(config.max_local_cpu_bytes),
                         ChunkedTokenDatabase(config, metadata), connector)


def measure(name: str, layers: int, heads: int, head_size: int, args: argparse.Namespace,
            packed: tuple[str, torch.dtype] | None = None, tuples: bool = False) -> Row:
    """`packed`: (ISA, dtype) of a vLLM-CPU packed cache; None: a paged bf16 cache, vLLM v1's or
    (`tuples`) the seed API's per-layer (K, V)."""
    from lmcache.integration.vllm.cpu_connector import VLLMCPUPackedConnector

    n = args.tokens
    dtype = packed[1] if packed else torch.bfloat16
    bs = PACKED_BLOCK if packed else args.block_size
    num_blocks = 2 * (n // bs)
    nbytes = 2 * layers * n * heads * head_size * dtype.itemsize
    shape = (num_blocks, heads, bs, 2 * head_size) if packed else (2, num_blocks, bs, heads, head_size)
    src_cache: list[Any] = caches(shape, layers, True, dtype)
    dst_cache: list[Any] = caches(shape, layers, False, dtype)
    if tuples:  # the same tensors, as (K, V) of [num_blocks, block_size, heads, head_size] per layer
        src_cache, dst_cache = ([(c[0], c[1]) for c in cache] for cache in (src_cache, dst_cache))
    layout, layout_from = packed_layout(packed[0], dtype, heads, head_size) if packed else (None, "-")

    def make_connector() -> GPUConnectorInterface:
        if layout is not None:
            return VLLMCPUPackedConnector(heads * head_size, layers, layout, use_native=not args.no_native)
        return VLLMPagedMemGPUConnectorV2(heads * head_size, layers, use_native=not args.no_native)

    blocks = torch.randperm(num_blocks)[: n // bs]
    slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()
    tokens = torch.randint(0, 49152, (n,))

    copy_src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    copy_dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    copy_times, store_times, retrieve_times, first_times = [], [], [], []
    engine = build_engine(layers, heads, head_size, nbytes, dtype, make_connector())
    for rep in range(args.reps):  # interleaved, so all of them see the same machine conditions
        t0 = time.perf_counter()
        copy_dst.copy_(copy_src)
        copy_times.append(time.perf_counter() - t0)
        fresh = build_engine(layers, heads, head_size, nbytes, dtype, make_connector())
        t0 = time.perf_counter()
        fresh.store(tokens, kvcaches=src_cache, slot_mapping=slots)  # its arena grows as it fills
        first_times.append(time.perf_counter() - t0)
        assert fresh.stats.get("stored_tokens") == n
        fresh.close()
        if rep:  # the engine has been filled once: its arena has grown to the request's size
            engine.storage_manager.clear("hot")
        t0 = time.perf_counter()
        engine.store(tokens, kvcaches=src_cache, slot_mapping=slots)  # cold: keys it does not hold
        store_times.append(time.perf_counter() - t0)
        assert engine.stats.get("stored_tokens") == (rep + 1) * n
        t0 = time.perf_counter()
        ret = engine.retrieve(tokens, kvcaches=dst_cache, slot_mapping=slots)
        retrieve_times.append(time.perf_counter() - t0)
        assert bool(ret.all())
    engine.close()
    for s, d in zip(src_cache, dst_cache, strict=True):  # the retrieved KV is the stored KV
        if packed:  # whole blocks hold the request's tokens, packed in vLLM's order
            assert torch.equal(s[blocks], d[blocks])
        else:
            hidden = heads * head_size
            s, d = (torch.stack(x) if tuples else x for x in (s, d))
            assert torch.equal(s.view(2, -1, hidden)[:, slots], d.view(2, -1, hidden)[:, slots])
    # the first repetition's cold store also grew the engine's arena: medians of the others
    store_times = store_times[1:] or store_times
    copy_s, store_s, retrieve_s, first_s = (statistics.median(t) for t in
                                            (copy_times, store_times, retrieve_times, first_times))
    gb = nbytes / 1e9
    label = f"vLLM-CPU {packed[0]}" if packed else "seed (K, V) tuples" if tuples else "vLLM v1 paged"
    return Row(name, label, layout_from, str(dtype).removeprefix("torch."), layers, heads, head_size, n,
               bs, nbytes, gb / copy_s, gb / store_s, gb / retrieve_s, copy_s / store_s,
               copy_s / retrieve_s, gb / first_s, copy_s / first_s)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    for i, (label, attr) in enumerate([("copy", "copy_gbps"), ("store (cold)", "store_cold_gbps"),
                                       ("retrieve", "retrieve_gbps")]):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], [getattr(r, attr) for r in rows],
               width, label=label)
    ax.set_xticks(range(len(rows)), [f"{r.shape}\n{r.layout} {r.dtype}" for r in rows], fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title(f"LMCache engine throughput on CPU ({rows[0].tokens} tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per request (multiple of 256)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions (medians)")
    parser.add_argument("--no-native", action="store_true", help="use the pure-torch copy paths")
    parser.add_argument("--no-packed", action="store_true", help="skip vLLM-CPU's packed layouts")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="comma-separated subset of " + ",".join(SHAPES) + " (vLLM v1 paged rows)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    args = parser.parse_args()
    if args.tokens % 256 or args.tokens % args.block_size:
        parser.error("--tokens must be a multiple of 256 and of --block-size")

    wanted = args.rows.split(",")
    if unknown := set(wanted) - set(ROWS):
        parser.error(f"unknown rows {sorted(unknown)}; choose from {','.join(ROWS)}")
    packed = [PACKED[r] for r in wanted if r in PACKED and not args.no_packed]
    for isa, dtype, _, (_, heads, head_size) in packed:
        packed_layout(isa, dtype, heads, head_size)
    if packed:
        time.sleep(5)  # let the work vLLM's import started settle
    shapes = args.shapes.split(",") if "paged" in wanted else []
    rows = [measure(name, *SHAPES[name], args) for name in shapes]
    if "tuples" in wanted:
        rows.append(measure("SmolLM2-135M", *SHAPES["SmolLM2-135M"], args, tuples=True))
    rows += [measure(name, *shape, args, packed=(isa, dtype)) for isa, dtype, name, shape in packed]
    path = "torch" if args.no_native else f"native ({native.copy_isa()})"
    print(f"\nLMCache engine throughput: {args.tokens} tokens, 256-token chunks, {torch.get_num_threads()} "
          f"threads, {path} copy path; {cpu_line()}")
    print(f"{'shape':<14}{'layout':<20}{'layout from':<15}{'dtype':<10}{'block':>6}{'MB':>6}{'copy GB/s':>11}"
          f"{'store GB/s':>12}{'ratio':>7}{'retrieve GB/s':>15}{'ratio':>7}"
          f"{'new engine GB/s':>17}{'ratio':>7}")
    for r in rows:
        print(f"{r.shape:<14}{r.layout:<20}{r.layout_from:<15}{r.dtype:<10}{r.block_size:>6}"
              f"{r.bytes / 1e6:>6.0f}{r.copy_gbps:>11.2f}{r.store_cold_gbps:>12.2f}{r.store_ratio:>7.2f}"
              f"{r.retrieve_gbps:>15.2f}{r.retrieve_ratio:>7.2f}{r.first_store_gbps:>17.2f}"
              f"{r.first_store_ratio:>7.2f}")
    print("goal: store (cold) and retrieve >= 0.70x copy; 'new engine': the first store into a new engine, "
          f"whose arena grows as it fills (one piece, {GROW_BYTES >> 20} MB, is ready at start-up)")
    OUT.mkdir(exist_ok=True)
    suffix = "-torch" if args.no_native else ""
    result = {**cpu_info(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
              "copy_path": path, "args": vars(args), "rows": [asdict(r) for r in rows]}
    (OUT / f"engine_throughput{suffix}.json").write_text(json.dumps(result, indent=1))
    plot(rows, OUT / f"engine_throughput{suffix}.png")
    print(f"wrote {OUT / f'engine_throughput{suffix}.json'} and .png")


if __name__ == "__main__":
    main()
