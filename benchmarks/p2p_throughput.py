"""Peer-to-peer pull throughput: engine B loads a 32-chunk prefix that only engine A holds, vs raw
lm:// GETs of the same values from A's peer server.

A runs in its own process (this script with ``--serve``): an engine with `enable_p2p`, a real
Valkey as `lookup_url`, its peer server on 127.0.0.1; it stores an 8,192-token prefix of
SmolLM2-shaped KV (30 layers, 3 KV heads x 64, bf16; 32 chunks of 256 tokens, 5.9 MB each) from a
vLLM-style paged cache (`tier_throughput.Setup`) and registers the chunks. B, in this process, has
only the same `lookup_url` (no remote store); with its hot tier emptied before every repetition
(untimed), `engine.retrieve` of the whole prefix into an empty paged cache asks the lookup service
who holds the chunks, pulls them from A in one batch, verifies and promotes them and copies them
into the paged cache: what a user waits for. The baseline, alternating with it (`--reps` each,
medians): `LMCacheClient.get_many` (pipelined GETs) of the same chunk keys from A's peer server.
The retrieved KV is checked bit-identical once.

    python benchmarks/p2p_throughput.py [--reps 7]

Goal (issue 10): engine pull >= 0.7x the raw GETs. Writes benchmarks/out/p2p_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tier_throughput import CHUNK, CHUNK_BYTES, OUT, Setup, medians

from lmcache.server.client import LMCacheClient
from tests.helpers.servers import Valkey


def p2p_config(lookup_url: str) -> dict[str, Any]:
    return {"enable_p2p": True, "lookup_url": lookup_url, "distributed_url": "127.0.0.1:0",
            "remote_timeout": 30.0}


def prefix(n_tokens: int) -> torch.Tensor:
    return torch.randint(0, 30000, (n_tokens,), generator=torch.Generator().manual_seed(1))


def serve(lookup_url: str, n_tokens: int) -> None:
    """Engine A: store the prefix, register it, print its peer address, serve until stdin closes."""
    a = Setup(prefix(n_tokens), **p2p_config(lookup_url))
    peer = a.engine.storage_manager.backends["PeerBackend"]
    assert peer.lookup.flush(30), "the lookup service did not take A's chunks"  # type: ignore[attr-defined]
    print("ready", peer.address, flush=True)  # type: ignore[attr-defined]
    sys.stdin.read()
    a.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--serve", metavar="LOOKUP_URL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.serve:
        serve(args.serve, args.tokens)
        return
    work = Path(tempfile.mkdtemp(prefix="lmcache-p2p-"))
    valkey = Valkey(work).start()
    lookup_url = f"redis://127.0.0.1:{valkey.port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                        str(Path(__file__).resolve().parents[1])])}
    a = subprocess.Popen([sys.executable, __file__, "--serve", lookup_url, "--tokens", str(args.tokens)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert a.stdout is not None and a.stdin is not None
        line = a.stdout.readline().split()
        if line[:1] != ["ready"]:
            raise SystemExit(f"engine A did not start: {line}")
        host, _, port = line[1].rpartition(":")
        b = Setup(prefix(args.tokens), store=False, **p2p_config(lookup_url))
        raw = LMCacheClient(host, int(port), timeout=30)
        keys = [k.to_string() for k in b.keys]

        def raw_get() -> None:
            assert all(v is not None for v in raw.get_many(keys)), "A's peer server missed a chunk"

        b.empty_hot()
        b.retrieve()
        b.check()
        t_engine, t_raw = medians([b.retrieve, raw_get], args.reps, b.empty_hot)
        nbytes = len(keys) * CHUNK_BYTES
        row = {"chunks": len(keys), "chunk_MB": CHUNK_BYTES / 1e6, "engine_pull_s": t_engine,
               "raw_get_many_s": t_raw, "engine_GBps": nbytes / t_engine / 1e9,
               "raw_GBps": nbytes / t_raw / 1e9, "ratio": t_raw / t_engine}
        print(f"{len(keys)} chunks of {CHUNK} tokens ({nbytes / 1e6:.0f} MB): B's engine.retrieve from A "
              f"{t_engine * 1e3:.1f} ms ({row['engine_GBps']:.2f} GB/s), raw get_many from A's peer "
              f"server {t_raw * 1e3:.1f} ms ({row['raw_GBps']:.2f} GB/s): ratio {row['ratio']:.2f} "
              "(goal >= 0.7)")
        OUT.mkdir(exist_ok=True)
        (OUT / "p2p_throughput.json").write_text(json.dumps(
            {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
             "threads": torch.get_num_threads(), "reps": args.reps, **row}, indent=2))
        raw.close()
        b.close()
    finally:
        if a.stdin is not None:
            a.stdin.close()
        try:
            a.wait(30)
        except subprocess.TimeoutExpired:
            a.kill()
        valkey.kill()


if __name__ == "__main__":
    main()
