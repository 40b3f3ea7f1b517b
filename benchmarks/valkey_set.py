"""The Valkey tier's SET of one chunk: redis-py's own ``set`` of the joined value (what the tier did
before) against `RedisConnector.put`, which sends the RESP command from the chunk's parts as they
are. A real `valkey-server` on loopback; a 256-token chunk of SmolLM2-shaped bf16 KV (5.9 MB);
the two alternate, `--reps` each; medians of the wall time and of the calling thread's CPU time
(which other processes on the machine do not inflate).

    python benchmarks/valkey_set.py [--reps 21]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmcache.storage_backend.connectors.redis_connector import RedisConnector
from lmcache.storage_backend.connectors.url import parse_remote_url
from lmcache.storage_backend.serde.naive_serde import NaiveSerializer
from tests.helpers.servers import Valkey

SHAPE = (2, 30, 256, 192)  # K/V, layers, tokens, 3 heads x 64: SmolLM2-135M


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    valkey = Valkey(Path(tempfile.mkdtemp(prefix="lmcache-bench-"))).start()
    try:
        connector = RedisConnector(parse_remote_url(f"redis://127.0.0.1:{valkey.port}"), 5.0)
        chunk = torch.randn(SHAPE).to(torch.bfloat16)
        parts = NaiveSerializer().to_parts(chunk)
        runs: dict[str, Callable[[], object]] = {
            "redis-py set": lambda: connector.client.set("a", b"".join(parts)),
            "RedisConnector.put": lambda: connector.put("b", parts),
        }
        wall: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.reps):
            for name, run in runs.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                run()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
        assert connector.client.get("a") == connector.client.get("b")
    finally:
        valkey.kill()
    size = sum(memoryview(p).nbytes for p in parts)
    print(f"one SET of {size / 1e6:.1f} MB, medians of {args.reps}:")
    for name in runs:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"  {name:20} wall {w * 1e3:6.2f} ms ({size / w / 1e9:.2f} GB/s)  client CPU {c * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
