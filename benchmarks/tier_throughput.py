"""Retrieve throughput of the lower tiers vs. raw reads of the same bytes from the same store.

`--chunks` SmolLM2-shaped 256-token chunks (30 layers, 3 KV heads, head size 64, bf16 ->
KV_BLOB [2, 30, 256, 192], 5.9 MB each) are stored through each tier, then read back:
- disk:   `LocalDiskBackend.get_blocking` (open, key + header check, read into an arena buffer,
          xxh3 verify) vs. `readinto` of each of the same files into its own pre-faulted buffer;
- valkey: `RemoteBackend.get_blocking` over redis:// (GET, header + checksum, copy into an arena
          buffer) vs. plain redis-py `GET`s of the same keys (bytes, nothing else);
          plus the batched path (`batched_get_blocking`, one MGET) vs. raw `MGET`;
- lm://:  the same against `lmcache server`, raw = `LMCacheClient.get` / `get_many`.
Tier and raw runs alternate, `--reps` times each; the median is reported. Disk reads come from the
page cache (files were just written), so they measure the read path, not the device. Valkey and
the lm:// server run as local processes started by this script.

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
    tier: str
    path: str
    chunks: int
    chunk_bytes: int
    tier_gbps: float
    raw_gbps: float
    ratio: float


def median_pair(tier_fn: Callable[[], None], raw_fn: Callable[[], None], reps: int) -> tuple[float, float]:
    """Median seconds of `tier_fn` and `raw_fn`, run alternately (one warm-up each)."""
    tier_fn()
    raw_fn()
    tier_t, raw_t = [], []
    for _ in range(reps):
        for fn, out in ((tier_fn, tier_t), (raw_fn, raw_t)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(tier_t), statistics.median(raw_t)


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


def row(tier: str, path: str, n: int, nbytes: int, t_tier: float, t_raw: float) -> Row:
    tier_gbps, raw_gbps = n * nbytes / t_tier / 1e9, n * nbytes / t_raw / 1e9
    return Row(tier, path, n, nbytes, round(tier_gbps, 3), round(raw_gbps, 3), round(tier_gbps / raw_gbps, 3))


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

    def raw() -> None:
        for p, view in zip(paths, views):
            with open(p, "rb", buffering=0) as f:
                n = f.readinto(view)
            assert n == size

    t_tier, t_raw = median_pair(tier_reader(disk, keys, False), raw, reps)
    disk.close()
    return [row("disk", "per chunk", len(keys), size, t_tier, t_raw)]


def bench_remote(name: str, url: str, raw_get: Callable[[str], object], raw_mget: Callable[[list[str]], list],
                 config: LMCacheEngineConfig, meta: LMCacheEngineMetadata, alloc: MixedMemoryAllocator,
                 keys: list[CacheEngineKey], reps: int) -> list[Row]:
    cfg = LMCacheEngineConfig.from_defaults(**{**config.to_dict(), "local_disk": None, "remote_url": url})
    remote = RemoteBackend(cfg, meta, alloc.allocate)
    fill(remote, alloc, keys)
    rkeys = [k.to_string() for k in keys]
    size = len(raw_get(rkeys[0]))  # type: ignore[arg-type]

    def raw() -> None:
        for k in rkeys:
            assert raw_get(k) is not None

    def raw_batched() -> None:
        assert all(v is not None for v in raw_mget(rkeys))

    t1, r1 = median_pair(tier_reader(remote, keys, False), raw, reps)
    t2, r2 = median_pair(tier_reader(remote, keys, True), raw_batched, reps)
    remote.close()
    return [row(name, "per chunk", len(keys), size, t1, r1), row(name, "batched", len(keys), size, t2, r2)]


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
          f"{'ratio':>6}")
    for x in rows:
        print(f"{x.tier:8} {x.path:10} {x.chunks:6d} {x.chunk_bytes / 1e6:8.2f} {x.tier_gbps:9.2f} "
              f"{x.raw_gbps:9.2f} {x.ratio:6.2f}")
    OUT.mkdir(exist_ok=True)
    result = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "shape": list(SHAPE), "dtype": "bfloat16", "goal_ratio": 0.7, "rows": [asdict(x) for x in rows]}
    (OUT / "tier_throughput.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT / 'tier_throughput.json'}")


if __name__ == "__main__":
    main()
