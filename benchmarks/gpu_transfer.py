"""KV transfer between a CUDA KV cache and LMCache's pinned CPU tier, against the raw PCIe copy.

Needs a CUDA device; without one it says so and exits 0. Measured in one run, interleaved, medians:

1. Paged caches (vLLM v1 flash-attention layout, per layer ``[2, num_blocks, 16, heads,
   head_size]``, the request's blocks scattered over twice as many blocks), `--tokens` tokens,
   bf16, three KV shapes:
   - raw: one pinned-host <-> device ``copy_`` of the same byte count, each way;
   - store (cold): `LMCacheEngine.store` into a freshly built engine (hashing, allocation, the
     connector's gather + DMA) until its copy completed and the chunks are in the hot tier;
   - retrieve: `LMCacheEngine.retrieve` of all tokens into a zeroed paged cache until the
     caller's stream has them (the copy is event-ordered; no host sync inside);
   then the retrieved KV is checked bit for bit against the source cache.
2. `PrefixCacheLM` on a random-weight Llama (`LlamaConfig`: 16 layers, 8 KV heads x 128, hidden
   2048, bf16) and a `--prefix-tokens` prompt: plain forward (a fresh `DynamicCache`) vs the
   first prefill + store into a fresh engine vs the repeat with the prefix loaded. Each timed
   region starts after ``torch.cuda.synchronize()`` and ends once its device work has finished
   (the plain forward and the repeat: ``torch.cuda.synchronize()``, which issue 36's first run
   left out); the first prefill is reported twice: until
   the caller's stream is done (what the caller waits for: the store's device-to-host copy runs on
   behind it) and until the store has completed (``drain`` + device synchronisation).

    python benchmarks/gpu_transfer.py [--tokens 8192] [--reps 7] [--shapes ...] [--kernel auto]
                                      [--out DIR] [--name STEM] [--budget-s S]

`--budget-s` bounds the run for a short device lease: once that many seconds have passed, each
remaining measurement stops after its current repetition (at least one timed one; the JSON's
``reps_done`` says how many). Writes DIR/STEM.json and .png (default benchmarks/out/gpu_transfer).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.memory_management import MixedMemoryAllocator
from lmcache.token_database import ChunkedTokenDatabase

SHAPES = {"8B-like": (32, 8, 128), "70B-TP8": (80, 1, 128), "SmolLM2-135M": (30, 3, 64)}
OUT = Path(__file__).parent / "out"
CHUNK = 256
GIB = 1 << 30


@dataclass
class ShapeRow:
    shape: str
    layers: int
    kv_heads: int
    head_size: int
    tokens: int
    bytes: int
    d2h_gbps: float
    store_cold_gbps: float
    store_ratio: float
    h2d_gbps: float
    retrieve_gbps: float
    retrieve_ratio: float
    bit_exact: bool
    reps_done: int
    profile: list[dict] | None = None  # --profile: the top device ops of one store + retrieve


@dataclass
class PrefixRow:
    tokens: int
    kv_bytes: int
    plain_forward_s: float
    first_prefill_store_s: float
    first_prefill_store_complete_s: float
    repeat_s: float
    repeat_speedup: float
    first_vs_plain: float
    first_complete_vs_plain: float
    cached_tokens: int
    kv_bit_exact: bool
    reps_done: int


def out_of_time(args: argparse.Namespace) -> bool:
    """True once `--budget-s` seconds have passed since the start (never without a budget)."""
    return args.budget_s is not None and time.monotonic() - args.started > args.budget_s


def timed(fn: Callable[[], object]) -> float:
    """Seconds from an idle device until `fn`'s device work has finished. (Issue 36's first run
    stopped the clock when `fn` returned: the plain forward and the repeat were timed until their
    kernels were issued, plus whatever the forward synchronised inside.)"""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def paged_engine(layers: int, heads: int, head_size: int, nbytes: int,
                 connector: VLLMPagedMemGPUConnectorV2) -> LMCacheEngine:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=nbytes * 1.05 / GIB)
    metadata = LMCacheEngineMetadata("bench", 1, 0, "vllm", torch.bfloat16,
                                     (layers, 2, CHUNK, heads, head_size))
    return LMCacheEngine(config, metadata, MixedMemoryAllocator(config.max_local_cpu_bytes),
                         ChunkedTokenDatabase(config, metadata), connector)


def measure_shape(name: str, layers: int, heads: int, head_size: int, args: argparse.Namespace) -> ShapeRow:
    n, bs, dev = args.tokens, args.block_size, torch.device("cuda")
    hidden = heads * head_size
    num_blocks = 2 * n // bs
    src = [torch.randn(2, num_blocks, bs, heads, head_size, device=dev, dtype=torch.bfloat16)
           for _ in range(layers)]
    dst = [torch.zeros_like(t) for t in src]
    blocks = torch.randperm(num_blocks)[: n // bs]
    slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()  # on the CPU, as vLLM's worker builds it
    tokens = torch.randint(0, 32000, (n,))
    nbytes = 2 * layers * n * hidden * 2
    raw_dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    raw_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    connector = VLLMPagedMemGPUConnectorV2(hidden, layers, layout="flash_attn", staged_kernel=args.kernel)

    def store(engine: LMCacheEngine) -> None:
        engine.store(tokens, kvcaches=src, slot_mapping=slots)
        assert connector.drain(60)

    def retrieve(engine: LMCacheEngine) -> None:
        assert bool(engine.retrieve(tokens, kvcaches=dst, slot_mapping=slots).all())
        torch.cuda.current_stream().synchronize()

    times: dict[str, list[float]] = {k: [] for k in ("d2h", "h2d", "store", "retrieve")}
    for rep in range(args.reps + 1):  # rep 0 warms up (Triton compile, staging, pinned pools)
        d2h = timed(lambda: (raw_host.copy_(raw_dev, non_blocking=True), torch.cuda.synchronize()))
        h2d = timed(lambda: (raw_dev.copy_(raw_host, non_blocking=True), torch.cuda.synchronize()))
        engine = paged_engine(layers, heads, head_size, nbytes, connector)
        t_store = timed(lambda engine=engine: store(engine))
        assert engine.stats.get("stored_tokens") == n, "the cold store did not store every token"
        for t in dst:
            t.zero_()
        t_retrieve = timed(lambda engine=engine: retrieve(engine))
        assert connector.drain(60)
        engine.close()
        del engine
        gc.collect()
        if rep:
            for key, value in zip(times, (d2h, h2d, t_store, t_retrieve), strict=True):
                times[key].append(value)
            if out_of_time(args):
                break
    def store_and_retrieve() -> None:
        engine = paged_engine(layers, heads, head_size, nbytes, connector)
        store(engine)
        retrieve(engine)
        assert connector.drain(60)
        engine.close()

    profile = None
    if args.profile:
        try:  # a profiler that fails here must not cost the measured figures
            profile = profile_once(store_and_retrieve)
        except Exception as e:  # noqa: BLE001
            print(f"  profile failed: {type(e).__name__}: {e}")
    slots_dev = slots.to(dev)
    exact = all(torch.equal(s.view(2, -1, hidden)[:, slots_dev], d.view(2, -1, hidden)[:, slots_dev])
                for s, d in zip(src, dst, strict=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    return ShapeRow(name, layers, heads, head_size, n, nbytes, gb / med["d2h"], gb / med["store"],
                    med["d2h"] / med["store"], gb / med["h2d"], gb / med["retrieve"],
                    med["h2d"] / med["retrieve"], exact, len(times["d2h"]), profile)


def profile_once(fn: Callable[[], object]) -> list[dict]:
    """The device ops of one call of `fn` (torch.profiler, CUPTI), by device time: where a slow
    request spends its time (kernels vs DMA vs gaps). Printed, and kept in the JSON row."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    top = [{"name": e.key[:80], "calls": e.count, "device_ms": e.self_device_time_total / 1e3,
            "host_ms": e.cpu_time_total / 1e3} for e in events[:8]]
    print(f"  profile: one cold store + retrieve, {wall * 1e3:.1f} ms wall; top device ops:")
    for row in top:
        print(f"    {row['device_ms']:8.2f} ms device {row['calls']:5d}x  {row['name']}")
    return [{"wall_ms": wall * 1e3}, *top]


def measure_prefix(args: argparse.Namespace) -> PrefixRow:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from lmcache.integration.transformers import HFKVConnector, KVGeometry, PrefixCacheLM, hf_engine_metadata

    n = args.prefix_tokens
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=n + 64)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, n))
    ids_dev = ids.cuda()
    kv_bytes = 2 * cfg.num_hidden_layers * n * cfg.num_key_value_heads * cfg.head_dim * 2
    engine_cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=kv_bytes * 1.1 / GIB)
    metadata = hf_engine_metadata(model, engine_cfg, model_name="bench-llama")
    geo = KVGeometry.of(model)
    connector = HFKVConnector(geo.num_layers, geo.num_kv_heads, geo.head_size)  # one, as in a server

    @torch.inference_mode()
    def plain() -> None:
        model(input_ids=ids_dev, past_key_values=DynamicCache(config=model.config), use_cache=True,
              logits_to_keep=1)

    times: dict[str, list[float]] = {k: [] for k in ("plain", "first", "first_complete", "repeat")}
    cached, exact = 0, False
    for rep in range(args.prefix_reps + 1):  # rep 0 warms up
        t_plain = timed(plain)
        instance = f"gpu-transfer-{rep}"
        engine = LMCacheEngineBuilder.get_or_create(instance, engine_cfg, metadata, connector)
        lm = PrefixCacheLM(model, engine)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = lm.prefill(ids)
        torch.cuda.current_stream().synchronize()
        t_first = time.perf_counter() - t0
        assert connector.drain(60)
        torch.cuda.synchronize()
        t_first_complete = time.perf_counter() - t0
        holder: list = []
        t_repeat = timed(lambda lm=lm, holder=holder: holder.append(lm.prefill(ids)))
        second = holder[0]
        cached = second.num_cached_tokens
        exact = all(torch.equal(a.keys[:, :, :cached], b.keys[:, :, :cached])
                    and torch.equal(a.values[:, :, :cached], b.values[:, :, :cached])
                    for a, b in zip(first.past_key_values.layers, second.past_key_values.layers, strict=True))
        del first, second, holder, lm, engine
        LMCacheEngineBuilder.destroy(instance)
        gc.collect()
        if rep:
            for key, value in zip(times, (t_plain, t_first, t_first_complete, t_repeat), strict=True):
                times[key].append(value)
            if out_of_time(args):
                break
    med = {k: statistics.median(v) for k, v in times.items()}
    return PrefixRow(n, kv_bytes, med["plain"], med["first"], med["first_complete"], med["repeat"],
                     med["plain"] / med["repeat"], med["first"] / med["plain"],
                     med["first_complete"] / med["plain"], cached, exact, len(times["plain"]))


def plot(rows: list[ShapeRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    bars = [("raw D2H", "d2h_gbps"), ("store (cold)", "store_cold_gbps"), ("raw H2D", "h2d_gbps"),
            ("retrieve", "retrieve_gbps")]
    for i, (label, attr) in enumerate(bars):
        ax.bar([x + (i - 1.5) * width for x in range(len(rows))], [getattr(r, attr) for r in rows], width,
               label=label)
    ax.set_xticks(range(len(rows)), [r.shape for r in rows])
    ax.set_ylabel("GB/s")
    ax.set_title(f"LMCache CUDA transfer ({rows[0].tokens} tokens, paged block 16, bf16)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, -0.32), ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per request (multiple of 256)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions (medians)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("--kernel", default="auto", choices=["auto", "triton", "torch"],
                        help="row kernel of the staged path")
    parser.add_argument("--prefix-tokens", type=int, default=8192)
    parser.add_argument("--prefix-reps", type=int, default=5)
    parser.add_argument("--skip-prefix", action="store_true", help="skip the PrefixCacheLM case")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one cold store per shape (torch.profiler, a few seconds)")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the JSON and PNG")
    parser.add_argument("--name", default="gpu_transfer", help="file stem of the JSON and PNG")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop repeating once this many seconds have passed (see above)")
    args = parser.parse_args()
    args.started = time.monotonic()
    if not torch.cuda.is_available():
        print("gpu_transfer: no CUDA device here; this benchmark measures CUDA <-> pinned-host transfers "
              "and runs only where CUDA is present. Nothing measured.")
        return
    if args.tokens % CHUNK or args.tokens % args.block_size:
        parser.error("--tokens must be a multiple of 256 and of --block-size")

    device = torch.cuda.get_device_name()
    rows = [measure_shape(name, *SHAPES[name], args) for name in args.shapes.split(",") if name]
    prefix = None if args.skip_prefix else measure_prefix(args)
    kernel = VLLMPagedMemGPUConnectorV2(8, 1, staged_kernel=args.kernel).staged_copier(
        torch.device("cuda", torch.cuda.current_device())).kernel

    print(f"\nLMCache CUDA transfer on {device} (torch {torch.__version__}, staged kernel: {kernel}): "
          f"{args.tokens} tokens, 256-token chunks, bf16, vLLM flash-attn paged cache (block "
          f"{args.block_size}, scattered), medians of {args.reps} interleaved reps")
    print(f"{'shape':<14}{'MB':>7}{'raw D2H':>9}{'store':>8}{'ratio':>7}{'raw H2D':>9}{'retrieve':>10}"
          f"{'ratio':>7}  bit-exact   (GB/s)")
    for r in rows:
        print(f"{r.shape:<14}{r.bytes / 1e6:>7.0f}{r.d2h_gbps:>9.2f}{r.store_cold_gbps:>8.2f}"
              f"{r.store_ratio:>7.2f}{r.h2d_gbps:>9.2f}{r.retrieve_gbps:>10.2f}{r.retrieve_ratio:>7.2f}"
              f"  {r.bit_exact}")
    print("goal: store (cold) and retrieve >= 0.85x the raw copy")
    if prefix is not None:
        p = prefix
        print(f"\nPrefixCacheLM, random Llama (16 layers, 8 KV heads x 128, bf16), {p.tokens}-token prompt, "
              f"{p.kv_bytes / 2**20:.0f} MiB of KV, medians of {args.prefix_reps} interleaved reps")
        print(f"  plain forward                     {p.plain_forward_s * 1e3:8.1f} ms")
        print(f"  first prefill + store (caller)    {p.first_prefill_store_s * 1e3:8.1f} ms  "
              f"{p.first_vs_plain:.2f}x plain (goal <= 1.15x)")
        print(f"  first prefill + store (completed) {p.first_prefill_store_complete_s * 1e3:8.1f} ms  "
              f"{p.first_complete_vs_plain:.2f}x plain")
        print(f"  repeat, prefix loaded             {p.repeat_s * 1e3:8.1f} ms  "
              f"{p.repeat_speedup:.2f}x faster (goal >= 3.5x); {p.cached_tokens} tokens loaded, "
              f"KV bit-exact: {p.kv_bit_exact}")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / f"{args.name}.json", args.out / f"{args.name}.png"
    result = {"device": device, "torch": torch.__version__, "kernel": kernel, "machine": platform.machine(),
              "date": time.strftime("%Y-%m-%d"),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "rows": [asdict(r) for r in rows],
              "prefix_cache": asdict(prefix) if prefix else None}
    json_path.write_text(json.dumps(result, indent=1))
    if rows:
        plot(rows, png_path)
    print(f"wrote {json_path} and .png")


if __name__ == "__main__":
    main()
