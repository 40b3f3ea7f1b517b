"""How loud a flapping incident is: warnings per engine while a Valkey primary fails over.

Three engines, each in its own process with a 4 MB hot tier (16 chunks of 256 tokens, 256 KB
each) and two threads that store a new 1,024-token document and retrieve an earlier one, over
and over, share a remote tier at a Valkey sentinel (`redis-sentinel://`) that watches a primary
and its replica (down after 1 s). A third of the way in the primary is SIGKILLed; the sentinel
promotes the replica and the engines follow it. The hot tiers are small on purpose: writes in
flight to the remote tier hold their chunks, so stores keep finding the arena full of KV in use,
and stores succeed in between (the pressure flaps). Each engine counts the warnings the
``lmcache`` loggers emit, grouped by what they are about.

    python benchmarks/failover_warnings.py [--seconds 45] [--kill-at 15]

Goal (issue 35): at most a few warnings per engine (the outage itself: about one). Writes
benchmarks/out/failover_warnings.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis
import torch

from tests.helpers.paged_kv import PagedKV, build_engine
from tests.helpers.servers import REPO, Valkey

OUT = Path(__file__).parent / "out"
CHUNK = 256
DOC = 1024
SHAPE = {"layers": 4, "heads": 8, "head_size": 8}  # 256 KB per chunk in bf16
HOT_BYTES = 4 << 20
THREADS = 2


def kind(message: str) -> str:
    """What a warning is about."""
    if "arena" in message:
        return "arena full"
    if "remote" in message.lower():
        return "remote store"
    return "other"


class CountWarnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.kinds: Counter[str] = Counter()
        self.messages: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.kinds[kind(message)] += 1
        self.messages[message[:110]] += 1


def run_engine(url: str, seconds: float, seed: int) -> dict[str, Any]:
    """One engine storing and retrieving from `THREADS` threads for `seconds`; its warnings."""
    torch.set_num_threads(1)
    counted = CountWarnings()
    logging.getLogger("lmcache").addHandler(counted)
    engine = build_engine(CHUNK, cpu_bytes=HOT_BYTES, remote_url=url, remote_timeout=1.0, **SHAPE)
    print("ready", flush=True)
    stop = time.monotonic() + seconds
    ops = Counter[str]()

    def work(tid: int) -> None:
        rng = random.Random(seed * 100 + tid)
        kv = PagedKV(block_size=16, num_blocks=DOC // 16 + 2, **SHAPE)
        slots = kv.slots_for(DOC)
        docs: list[torch.Tensor] = []
        while time.monotonic() < stop:
            generator = torch.Generator().manual_seed(rng.getrandbits(31))
            tokens = torch.randint(0, 30000, (DOC,), generator=generator)
            engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
            docs.append(tokens)
            hit = engine.retrieve(docs[rng.randrange(len(docs))], kvcaches=kv.layers, slot_mapping=slots)
            ops["stores"] += 1
            ops["retrieved_tokens"] += int(hit.sum())

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report = engine.stats.report()
    engine.close()
    remote = report["tiers"].get("RemoteBackend", {}).get("counters", {})
    return {"warnings": sum(counted.kinds.values()), "by_kind": dict(counted.kinds),
            "messages": dict(counted.messages.most_common(5)), **ops,
            "store_dropped_tokens": report["engine"].get("store_dropped_tokens", 0),
            "remote": {k: remote.get(k, 0) for k in ("failures", "skipped", "puts_written", "puts_failed",
                                                      "puts_dropped")}}


def start_store(workdir: Path) -> tuple[Valkey, Valkey, Valkey]:
    """A primary, its replica (in sync) and a sentinel that knows both."""
    primary = Valkey(workdir).start()
    replica = Valkey(workdir, None, "--replicaof", "127.0.0.1", str(primary.port)).start()
    sentinel = Valkey(workdir, None, sentinel_of=primary.port, down_after_ms=1000).start()
    s, r = redis.Redis(port=sentinel.port), redis.Redis(port=replica.port)
    deadline = time.monotonic() + 30
    while not (r.info("replication").get("master_link_status") == "up"
               and s.execute_command("SENTINEL", "REPLICAS", "lmc")):
        if time.monotonic() > deadline:
            raise TimeoutError("the replica or the sentinel did not come up")
        time.sleep(0.2)
    return primary, replica, sentinel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--kill-at", type=float, default=15.0)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--engine", nargs=3, metavar=("URL", "SECONDS", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        url, seconds, seed = args.engine
        print(json.dumps(run_engine(url, float(seconds), int(seed))), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        primary, replica, sentinel = start_store(Path(tmp))
        url = f"redis-sentinel://127.0.0.1:{sentinel.port}/lmc"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        procs = [subprocess.Popen([sys.executable, __file__, "--engine", url, str(args.seconds), str(i)],
                                  stdout=subprocess.PIPE, text=True, env=env)
                 for i in range(args.engines)]
        try:
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            time.sleep(args.kill_at)
            primary.kill()
            results = [json.loads(p.communicate(timeout=args.seconds + 120)[0].splitlines()[-1])
                       for p in procs]
            master = redis.Redis(port=sentinel.port).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME",
                                                                     "lmc")
            failed_over = int(master[1]) == replica.port
        finally:
            for p in procs:
                p.kill()
            for v in (primary, replica, sentinel):
                v.kill()
    print(f"{args.engines} engines x {THREADS} threads, {HOT_BYTES >> 20} MB hot tiers, {args.seconds:g} s, "
          f"primary SIGKILLed at {args.kill_at:g} s; failed over to the replica: {failed_over}")
    print(f"{'engine':>6} {'warnings':>8} {'arena':>6} {'remote':>6} {'other':>5} {'stores':>6} "
          f"{'dropped tok':>11} {'remote failures':>15} {'skipped':>7}")
    for i, r in enumerate(results):
        k = r["by_kind"]
        print(f"{i:>6} {r['warnings']:>8} {k.get('arena full', 0):>6} {k.get('remote store', 0):>6} "
              f"{k.get('other', 0):>5} {r['stores']:>6} {r['store_dropped_tokens']:>11.0f} "
              f"{r['remote']['failures']:>15.0f} {r['remote']['skipped']:>7.0f}")
    for i, r in enumerate(results):
        for message, n in r["messages"].items():
            print(f"  engine {i}: {n} x {message}")
    OUT.mkdir(exist_ok=True)
    (OUT / "failover_warnings.json").write_text(json.dumps(
        {"seconds": args.seconds, "kill_at": args.kill_at, "failed_over": failed_over, "engines": results},
        indent=1))


if __name__ == "__main__":
    main()
