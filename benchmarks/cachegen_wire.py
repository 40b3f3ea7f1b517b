"""Does CacheGen pay on the wire? Load time of 8B-like KV from an lm:// server vs link bandwidth.

8,192 tokens of 8B-like KV (32 layers, 8 KV heads x 128, bf16: 1.07 GB) are stored once per serde
(`naive`: raw bytes, `cachegen`) in a real `lmcache server`. Each measurement builds a fresh engine
(`LMCacheEngineBuilder`; hot CPU tier on but empty, so every chunk comes from the server) whose
`remote_url` points at a rate-limiting loopback proxy (`rate_limited_proxy.py`, a token bucket per
direction) and times `LMCacheEngine.retrieve` of all 8,192 tokens into a vLLM-v1-style paged cache
— what a serving engine sees: transfer, checksum, CacheGen decode, copy into the paged cache. Rates
and serdes are interleaved in every repetition; the table shows medians and the ratio naive /
cachegen (> 1: CacheGen loads faster).

There is no 8B model here: the KV is SmolLM2-135M's real KV of 8,192 tokens of the evaluation
texts laid out in the 8B shape (`cachegen_common.kv_8b_like`; CacheGen then uses the layer-count
default table of an unknown 32-layer model); the bytes the server holds per serde are printed.
The proxy is Python in its own process; the `naive` row at the highest rate shows what it sustains.

    python benchmarks/cachegen_wire.py [--rates 0.5,1,2.5,10] [--reps 3] [--tokens 8192]

Writes benchmarks/out/cachegen_wire.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from cachegen_common import kv_8b_like

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from tests.helpers.servers import LMServer

OUT = Path(__file__).parent / "out"
LAYERS, KV_HEADS, HEAD_SIZE, CHUNK, BLOCK = 32, 8, 128, 256, 16
SERDES = ("naive", "cachegen")


class PagedKV:
    """A vLLM-v1-style paged cache (per layer [2, blocks, block, heads, head]) and the slots of
    `tokens` tokens in randomly placed blocks."""

    def __init__(self, tokens: int, seed: int) -> None:
        nblocks = tokens // BLOCK * 5 // 4
        self.layers = [torch.zeros(2, nblocks, BLOCK, KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
                       for _ in range(LAYERS)]
        g = torch.Generator().manual_seed(seed)
        blocks = torch.randperm(nblocks, generator=g)[: tokens // BLOCK]
        self.slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()

    def write(self, kv: torch.Tensor) -> None:
        for layer, cache in enumerate(self.layers):
            cache.view(2, -1, KV_HEADS * HEAD_SIZE)[:, self.slots] = kv[:, layer]

    def read(self) -> torch.Tensor:
        return torch.stack([c.view(2, -1, KV_HEADS * HEAD_SIZE)[:, self.slots] for c in self.layers], 1)


def engine(name: str, url: str, serde: str, nbytes: int) -> LMCacheEngine:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, remote_url=url, remote_serde=serde,
                                               max_local_cpu_size=nbytes * 1.1 / (1 << 30),
                                               remote_timeout=120.0)
    metadata = LMCacheEngineMetadata(f"bench-8b-like-{serde}", 1, 0, "vllm", torch.bfloat16,
                                     (LAYERS, 2, CHUNK, KV_HEADS, HEAD_SIZE))
    connector = VLLMPagedMemGPUConnectorV2(KV_HEADS * HEAD_SIZE, LAYERS)
    return LMCacheEngineBuilder.get_or_create(name, config, metadata, connector)


class Proxy:
    def __init__(self, target_port: int, gbps: float) -> None:
        script = Path(__file__).with_name("rate_limited_proxy.py")
        self.proc = subprocess.Popen([sys.executable, str(script), "--target",
                                      f"127.0.0.1:{target_port}", "--gbps", str(gbps)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        m = re.search(r":(\d+)$", self.proc.stdout.readline().strip()) if ready else None
        if m is None:
            self.proc.kill()
            raise RuntimeError("rate-limiting proxy did not start")
        self.url = f"lm://127.0.0.1:{m.group(1)}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for serde, style in (("naive", "s-"), ("cachegen", "o-")):
        pts = [(r["gbps"], r[f"{serde}_s"]) for r in rows]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=serde)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([r["gbps"] for r in rows], [f"{r['gbps']:g}" for r in rows])
    ax.set_xlabel("link bandwidth (Gbit/s, loopback proxy)")
    ax.set_ylabel("retrieve time (s), median")
    ax.set_title(f"Loading {rows[0]['tokens']} tokens of 8B-like KV from lm:// (engine.retrieve)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="0.5,1,2.5,10", help="Gbit/s, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    ntok = args.tokens
    tokens = torch.arange(ntok) % 50000
    kv = kv_8b_like(ntok, LAYERS, KV_HEADS * HEAD_SIZE)
    nbytes = kv.numel() * kv.element_size()
    source = PagedKV(ntok, seed=1)
    source.write(kv)
    server = LMServer("--max-size-gb", str(3 * nbytes / 2**30)).start()
    times: dict[tuple[float, str], list[float]] = {(r, s): [] for r in rates for s in SERDES}
    errors: dict[str, float] = {}
    try:
        for serde in SERDES:  # store once per serde, straight to the server
            writer = engine(f"writer-{serde}", server.url, serde, nbytes)
            writer.store(tokens, kvcaches=source.layers, slot_mapping=source.slots)
            deadline = time.monotonic() + 600  # remote puts are asynchronous: wait for all
            while writer.lookup(tokens, search_range="RemoteBackend") < ntok:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{serde}: the server did not get every chunk in 10 minutes")
                time.sleep(0.5)
            LMCacheEngineBuilder.destroy(f"writer-{serde}")
        for rep in range(args.reps):
            for rate in rates:
                proxy = Proxy(server.port, rate)
                try:
                    for serde in SERDES:
                        target = PagedKV(ntok, seed=2)
                        reader = engine(f"reader-{serde}", proxy.url, serde, nbytes)
                        t0 = time.perf_counter()
                        hit = reader.retrieve(tokens, kvcaches=target.layers, slot_mapping=target.slots)
                        elapsed = time.perf_counter() - t0
                        LMCacheEngineBuilder.destroy(f"reader-{serde}")
                        if int(hit.sum()) != ntok:
                            raise RuntimeError(f"{serde} at {rate} Gbit/s retrieved {int(hit.sum())} "
                                               f"of {ntok} tokens")
                        times[(rate, serde)].append(elapsed)
                        if rep == 0 and rate == rates[0]:
                            got = target.read().float()
                            errors[serde] = float((got - kv.float()).pow(2).mean().sqrt()
                                                  / kv.float().pow(2).mean().sqrt())
                        print(f"rep {rep} {rate:g} Gbit/s {serde}: {elapsed:.3f} s", flush=True)
                finally:
                    proxy.stop()
        blob_bytes = server_bytes(server)
    finally:
        server.stop()
    rows = []
    for rate in rates:
        naive_s, cg_s = (statistics.median(times[(rate, s)]) for s in SERDES)
        rows.append({"gbps": rate, "tokens": ntok, "naive_s": naive_s, "cachegen_s": cg_s,
                     "speedup": naive_s / cg_s, "naive_GBps": nbytes / naive_s / 1e9,
                     "cachegen_GBps_of_kv": nbytes / cg_s / 1e9})
    print(f"\n{'Gbit/s':>7s} {'naive s':>9s} {'cachegen s':>11s} {'naive/cachegen':>15s}")
    for r in rows:
        print(f"{r['gbps']:7g} {r['naive_s']:9.3f} {r['cachegen_s']:11.3f} {r['speedup']:14.2f}x")
    print(f"KV {nbytes / 1e9:.2f} GB; stored on the server: {blob_bytes}; relative RMS error of the "
          f"retrieved KV: {errors}")
    OUT.mkdir(exist_ok=True)
    (OUT / "cachegen_wire.json").write_text(json.dumps({
        "setup": {"tokens": ntok, "layers": LAYERS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE,
                  "kv_bytes": nbytes, "reps": args.reps, "machine": platform.machine(),
                  "torch_threads": torch.get_num_threads(), "server_bytes": blob_bytes,
                  "relative_rms_error": errors},
        "rows": rows, "times": {f"{r}:{s}": t for (r, s), t in times.items()}}, indent=2))
    plot(rows, OUT / "cachegen_wire.png")
    print(f"wrote {OUT / 'cachegen_wire.json'} and cachegen_wire.png")


def server_bytes(server: LMServer) -> dict[str, int]:
    """Bytes the server holds per serde (the keys carry the model name, which names the serde)."""
    from lmcache.server.client import LMCacheClient

    client = LMCacheClient("127.0.0.1", server.port, timeout=60.0)
    try:
        sizes: dict[str, int] = {}
        for key in client.list_keys():
            serde = "cachegen" if "cachegen" in key else "naive"
            sizes[serde] = sizes.get(serde, 0) + len(client.get(key) or b"")
        return sizes
    finally:
        client.close()


if __name__ == "__main__":
    main()
