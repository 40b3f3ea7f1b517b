"""Does an operator's lookup on the cache server hold up the engines attached to it?

A real valkey-server behind a TCP proxy that adds `--rtt` seconds of round-trip time
(`tests.helpers.servers.LatencyProxy`) is the remote tier of a cache server (`lmcache cache-server`
in a subprocess, on a temporary ipc socket). One engine attached to it (in this process; the unit
tests' tiny model: 2 layers, 8-token chunks, bf16) stores a 64-token document, then serves
requests through its cache-server client: store one fresh chunk, retrieve the document, a leased
lookup of it (see `tests.helpers.ops_load`). Requests are due every `--interval` seconds and timed
from when they were due. Each round runs `--per-op` requests of each kind twice: once while an
operator lookup (``POST /lookup`` of a document the server does not hold: it asks the remote tier,
for every tier's count too) is in flight, once without one; the order flips every round.

Reported: the median request time by kind with and without operator lookups, the difference
(added latency; goal < 5 ms), how long the operator lookups took, and whether every request
timed beside one ended while it was still in flight.

    python benchmarks/ops_stall.py [--rounds 30] [--per-op 5] [--rtt 0.5] [--interval 0.02]

Writes benchmarks/out/ops_stall.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_info

from tests.helpers.ops_load import OPS, EngineRequests, interleaved_rounds, operator_lookup
from tests.helpers.servers import CacheServerProcess, LatencyProxy, Valkey
from tests.unit.cache_server.engine_worker import build

OUT = Path(__file__).parent / "out"
GOAL_MS = 5.0
DOC = list(range(1000, 1064))  # 8 chunks of 8 tokens
COLD = list(range(9000, 9064))  # never stored: an operator lookup of it waits on the remote tier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--per-op", type=int, default=5, help="requests of each kind per round and side")
    ap.add_argument("--rtt", type=float, default=0.5, help="round-trip time added to the remote tier, s")
    ap.add_argument("--interval", type=float, default=0.02, help="seconds between the engine's requests")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmcache-ops-stall-"))
    valkey = Valkey(work).start()
    proxy = LatencyProxy(valkey.port, rtt=args.rtt)
    config = work / "tiers.yaml"
    config.write_text(json.dumps({"remote_url": f"redis://{proxy.url}", "remote_timeout": 30}))
    url = f"ipc://{work}/cache.sock"
    server = CacheServerProcess(url, "--config", str(config)).start()
    engine = None
    try:
        engine = build(url, heartbeat_timeout=30)
        requests = EngineRequests(engine, DOC)
        requests.prepare(seed=1)
        operator_lookup(server.http, COLD)  # the server's first remote calls connect
        t0 = time.monotonic()
        rounds = interleaved_rounds(server.http, requests, COLD, args.rounds, args.per_op, args.interval)
        seconds = time.monotonic() - t0
    finally:
        if engine is not None:
            engine.close()
        server.stop()
        proxy.close()
        valkey.kill()

    quiet, busy, added = rounds.medians_ms(False), rounds.medians_ms(True), rounds.added_ms()
    print(f"{'request':10} {'n':>5} {'without ms':>10} {'with ms':>8} {'added ms':>9}")
    for op in (*OPS, "all"):
        n = len(rounds.busy[op]) if op in OPS else sum(len(v) for v in rounds.busy.values())
        print(f"{op:10} {n:5d} {quiet[op]:10.2f} {busy[op]:8.2f} {added[op]:9.2f}")
    operator_s = statistics.median(rounds.operator)
    print(f"operator lookups: {len(rounds.operator)}, median {operator_s:.2f} s "
          f"(min {min(rounds.operator):.2f}); every timed request ended while one was in flight: "
          f"{rounds.overlapped}")
    print(f"goal: added < {GOAL_MS:g} ms (median over all requests): "
          f"{'met' if added['all'] < GOAL_MS else 'NOT met'}; {seconds:.0f} s")
    OUT.mkdir(exist_ok=True)
    result = {**cpu_info(), "args": vars(args), "median_ms_without": quiet, "median_ms_with": busy,
              "added_ms": added, "operator_lookup_s": rounds.operator, "overlapped": rounds.overlapped,
              "seconds_without": rounds.quiet, "seconds_with": rounds.busy}
    (OUT / "ops_stall.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT / 'ops_stall.json'}")


if __name__ == "__main__":
    main()
