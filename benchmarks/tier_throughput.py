"""Retrieve throughput of the lower tiers vs. raw reads of the same bytes from the same store.

`--chunks` SmolLM2-shaped 256-token chunks (30 layers, 3 KV heads, head size 64, bf16 ->
KV_BLOB [2, 30, 256, 192], 5.9 MB each) are stored through each tier, then read back:
- disk:   `LocalDiskBackend.get_blocking` (open, key + header check, read into an arena buffer,
          xxh3 verify) vs. `readinto` of each of the same files into its own pre-faulted buffer;
- valkey: `RemoteBackend.get_blocking` over redis:// (GET read into an arena buffer, header +
          checksum) vs. plain redis-py `GET`s of the same keys (bytes, nothing else);
          plus the batched path (`batched_get_blocking`, one MGET) vs. raw `MGET`;
- lm://:  the same against `lmcache server`, raw = `LMCacheClient.get` / `get_many`.
The tier keeps every chunk it reads until the pass ends, in pre-faulted arena memory. The goal's
`raw` baseline is the strictest plain read in the same situation: for disk, `readinto` of every
file into its own pre-faulted buffer; for the remote stores (whose clients allocate each value
themselves), GETs whose values are dropped at once, so one cache-hot buffer is reused (transport
only). The `other` column shows the other way for context: disk reads into one reused (L3-resident)
buffer, and remote GETs keeping every value (paying the page faults of fresh buffers). Batched MGET
results are one list either way. Tier and raw runs alternate, `--reps` times each (medians).
Disk reads come from the page cache (files were just written), so they measure the read path,
not the device. Valkey and the lm:// server run as local processes started by this script.

    python benchmarks/tier_throughput.py [--chunks 32] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import (
    HostMemoryAllocator,
    MemoryFormat,
    MixedMemoryAllocator,
    TensorMemoryAllocator,
)
from lmcache.server.client import LMCacheClient
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.storage_backend.lower_tier import LowerTierBackend
from lmcache.storage_backend.remote_backend import RemoteBackend
from lmcache.utils import CacheEngineKey
from tests.helpers.servers import LMServer, Valkey

OUT = Path(__file__).parent / "out"
LAYERS, KV_HEADS, HEAD_SIZE, TOKENS = 30, 3, 64, 256
SHAPE = torch.Size([2, LAYERS, TOKENS, KV_HEADS * HEAD_SIZE])


@dataclass
class Row:
    """`raw` is the goal's baseline, the strictest plain read that matches the tier's situation;
    `other` is the other way of reading, shown for context (see the module docstring)."""

    tier: str
    path: str
    chunks: int
    chunk_bytes: int
    tier_gbps: float
    raw_gbps: float
    ratio: float
    other_gbps: float
    other_ratio: float


def medians(fns: list[Callable[[], None]], reps: int) -> list[float]:
    """Median seconds of each function, run in turn `reps` times (after one warm-up each)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def fill(backend: LowerTierBackend, allocator: MixedMemoryAllocator, keys: list[CacheEngineKey]) -> None:
    for i, key in enumerate(keys):
        obj = allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_BLOB)
        assert obj is not None
        obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16))
        backend.submit_put_task(key, obj)
        obj.ref_count_down()
        backend.puts.flush(60)
    assert backend.puts.num_written == len(keys), "not every chunk was stored"


def tier_reader(backend: LowerTierBackend, keys: list[CacheEngineKey], batched: bool) -> Callable[[], None]:
    def read() -> None:
        objs = (backend.batched_get_blocking(keys) if batched and isinstance(backend, RemoteBackend)
                else [backend.get_blocking(k) for k in keys])
        for obj in objs:
            assert obj is not None, "tier missed a stored chunk"
            obj.ref_count_down()
    return read


def row(tier: str, path: str, n: int, nbytes: int, t_tier: float, t_raw: float, t_other: float) -> Row:
    gbps = [round(n * nbytes / t / 1e9, 3) for t in (t_tier, t_raw, t_other)]
    return Row(tier, path, n, nbytes, gbps[0], gbps[1], round(gbps[0] / gbps[1], 3), gbps[2],
               round(gbps[0] / gbps[2], 3))


def bench_disk(config: LMCacheEngineConfig, meta: LMCacheEngineMetadata, alloc: MixedMemoryAllocator,
               keys: list[CacheEngineKey], reps: int) -> list[Row]:
    disk = LocalDiskBackend(config, meta, alloc.allocate)
    fill(disk, alloc, keys)
    paths = [disk._key_to_path(k) for k in keys]
    size = os.path.getsize(paths[0])
    # one pre-faulted buffer per chunk, as a consumer of the chunks needs (and as the tier uses)
    raw_arena = HostMemoryAllocator(len(keys) * TensorMemoryAllocator.aligned_size(size))
    views = []
    for _ in keys:
        buf = raw_arena.allocate(torch.Size([size]), torch.uint8)
        assert buf is not None
        views.append(buf.byte_array)

    def read_files(targets: list[memoryview]) -> None:
        for p, view in zip(paths, targets):
            with open(p, "rb", buffering=0) as f:
                n = f.readinto(view)
            assert n == size

    one_buffer = views[:1] * len(paths)
    t_tier, t_kept, t_reused = medians(
        [tier_reader(disk, keys, False), lambda: read_files(views), lambda: read_files(one_buffer)], reps)
    disk.close()
    return [row("disk", "per chunk", len(keys), size, t_tier, t_kept, t_reused)]


def bench_remote(name: str, url: str, raw_get: Callable[[str], object], raw_mget: Callable[[list[str]], list],
                 config: LMCacheEngineConfig, meta: LMCacheEngineMetadata, alloc: MixedMemoryAllocator,
                 keys: list[CacheEngineKey], reps: int) -> list[Row]:
    cfg = LMCacheEngineConfig.from_defaults(**{**config.to_dict(), "local_disk": None, "remote_url": url})
    remote = RemoteBackend(cfg, meta, alloc.allocate)
    fill(remote, alloc, keys)
    rkeys = [k.to_string() for k in keys]
    size = len(raw_get(rkeys[0]))  # type: ignore[arg-type]

    def raw() -> None:  # each value dropped at once: the allocator reuses one cache-hot buffer
        for k in rkeys:
            assert raw_get(k) is not None

    def raw_kept() -> None:
        values = [raw_get(k) for k in rkeys]
        assert all(v is not None for v in values)

    def raw_batched() -> None:
        assert all(v is not None for v in raw_mget(rkeys))

    per_chunk = medians([tier_reader(remote, keys, False), raw, raw_kept], reps)
    t_batched, r_batched = medians([tier_reader(remote, keys, True), raw_batched], reps)
    remote.close()
    return [row(name, "per chunk", len(keys), size, *per_chunk),
            row(name, "batched", len(keys), size, t_batched, r_batched, r_batched)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    chunk_bytes = SHAPE.numel() * 2
    work = Path(tempfile.mkdtemp(prefix="lmcache-bench-"))
    disk_gb = (args.chunks + 4) * chunk_bytes * 1.1 / 2**30
    config = LMCacheEngineConfig.from_defaults(local_disk=str(work / "disk"), max_local_disk_size=disk_gb)
    meta = LMCacheEngineMetadata("SmolLM2-135M", 1, 0, "vllm", torch.bfloat16,
                                 (LAYERS, 2, TOKENS, KV_HEADS, HEAD_SIZE))
    # room for the chunks being filled plus one full read-back (every object is released after use)
    alloc = MixedMemoryAllocator(int((args.chunks + 4) * chunk_bytes * 1.05))
    keys = [CacheEngineKey("kv_blob", meta.model_name, 1, 0, f"{i:032x}", "bfloat16")
            for i in range(args.chunks)]

    rows = bench_disk(config, meta, alloc, keys, args.reps)
    valkey = Valkey(work).start()
    lm = LMServer("--max-size-gb", str((args.chunks + 8) * chunk_bytes * 1.2 / 2**30)).start()
    try:
        r = redis.Redis(port=valkey.port)
        rows += bench_remote("valkey", valkey.url, r.get, r.mget, config, meta, alloc, keys, args.reps)
        c = LMCacheClient("127.0.0.1", lm.port)
        rows += bench_remote("lm://", lm.url, c.get, c.get_many, config, meta, alloc, keys, args.reps)
        r.close()
        c.close()
    finally:
        valkey.kill()
        lm.stop()

    print(f"{'tier':8} {'path':10} {'chunks':>6} {'MB/chunk':>8} {'tier GB/s':>9} {'raw GB/s':>9} "
          f"{'ratio':>6} {'other GB/s':>10} {'ratio':>6}")
    for x in rows:
        print(f"{x.tier:8} {x.path:10} {x.chunks:6d} {x.chunk_bytes / 1e6:8.2f} {x.tier_gbps:9.2f} "
              f"{x.raw_gbps:9.2f} {x.ratio:6.2f} {x.other_gbps:10.2f} {x.other_ratio:6.2f}")
    print("goal: tier >= 0.70x raw")
    OUT.mkdir(exist_ok=True)
    result = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "shape": list(SHAPE), "dtype": "bfloat16", "goal_ratio": 0.7, "rows": [asdict(x) for x in rows]}
    (OUT / "tier_throughput.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT / 'tier_throughput.json'}")


if __name__ == "__main__":
    main()
