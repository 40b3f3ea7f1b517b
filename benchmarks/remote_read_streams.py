"""A remote tier's batched get over one connection or over `SEALED_READ_STREAMS` (2) at once.

`engine.retrieve` of an 8,192-token prefix (SmolLM2-shaped bf16 KV, 32 chunks of 5.9 MB) from a
real Valkey and a real lm:// server, plain and sealed (`kv_encryption_key`), with the hot tier
emptied before each retrieve (as `tier_throughput.py` does); the remote tier's `read_streams` set
to 1 and 2 alternately, `--reps` each; medians. (The tier reads sealed values over 2 connections,
unsealed ones over 1: what this measured.)

    python benchmarks/remote_read_streams.py [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tier_throughput import LMServer, Setup, Valkey

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmcache.storage_backend import remote_backend
from lmcache.storage_backend.serde.seal import write_key_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmcache-bench-"))
    key = str(work / "kv.key")
    write_key_file(key)
    tokens = torch.arange(8192)
    valkey, lm = Valkey(work).start(), LMServer("--max-size-gb", "2").start()
    try:
        for label, url in (("valkey", f"redis://127.0.0.1:{valkey.port}"), ("lm://", lm.url)):
            for sealed in (False, True):
                cfg: dict[str, object] = {"remote_url": url + ("?namespace=sealed" if sealed else ""),
                                          "remote_timeout": 30}
                if sealed:
                    cfg["kv_encryption_key"] = key
                setup = Setup(tokens, **cfg)
                tier = setup.engine.storage_manager.backends["RemoteBackend"]
                times: dict[int, list[float]] = {1: [], remote_backend.SEALED_READ_STREAMS: []}
                for _ in range(args.reps):
                    for streams in times:
                        tier.read_streams = streams  # type: ignore[attr-defined]
                        setup.empty_hot()
                        t0 = time.perf_counter()
                        setup.retrieve()
                        times[streams].append(time.perf_counter() - t0)
                setup.check()
                setup.close()
                (one, n_one), (many, n_many) = ((statistics.median(t), n) for n, t in times.items())
                print(f"{label:7} {'sealed' if sealed else 'plain':6}  {n_one} stream {one * 1e3:6.0f} ms   "
                      f"{n_many} streams {many * 1e3:6.0f} ms   speed-up {one / many:.2f}x")
    finally:
        valkey.kill()
        lm.stop()


if __name__ == "__main__":
    main()
