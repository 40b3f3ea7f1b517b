"""A fleet of two vLLM-CPU instances behind `lmcache router`: which policy serves a multi-round chat
fastest, on the instances' own LMCache tiers and on one shared cache server.

Two vLLM-CPU OpenAI servers (a core each, at niceness --engine-nice so that the users' requests
leave on time, fp32 SmolLM2-135M, vLLM's KV events on, prompt-token details on) run behind one
`lmcache router` process per policy (``round-robin``, ``session``, ``kv-aware``). Setups (one
after the other, the instances started afresh for each):

    own      each instance with its own LMCache CPU hot tier
    shared   both instances on one `lmcache cache-server` (shared-memory L1); the routers watch its
             KV events too (``--shared-kv-events``)

Workloads (chat completions, streamed; users concurrent, each user's rounds in order; each answer
appended to the user's history; the users start 0.2 s apart so that ``session`` meets them in order;
``--think`` adds a random pause, the same for every policy and other in every repeat, before each
later round):

    balanced  --users users, --rounds rounds, a --system-words shared system text and a
              --doc-words document each
    skewed    the same, but --heavy of the users, every other one (0, 2, 4, ...; default: half of
              them), have a document --skew times longer and twice the rounds: ``session`` (first
              sight in turn) piles them onto one instance

Runs are interleaved within a setup: repeat x workload x policy, each run with its own text salt
(so no run finds another's KV; of the same token length in every run, `salt_of`); before them each
instance answers one request of other text, so that no run meets a fresh instance. Reported per
(setup, workload, policy): mean and p90 TTFT of rounds >= 2 (median over repeats of each run's
value), output throughput, prompt tokens by source (vLLM's prefix cache = ``local_cache_hit``,
LMCache = ``external_kv_transfer``) and LMCache's tier hits, and
the router's predicted vs served hit tokens; then the issue's goals as ratios.

    python benchmarks/fleet_routing.py [--quick] [--setups own,shared] [--repeats 2]

Writes benchmarks/out/fleet_routing.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.helpers.openai_server import MODEL_NAME, PROMPT_SOURCES, OpenAIServer, metric
from tests.helpers.servers import REPO, CacheServerProcess, free_port, wait_port
from tests.helpers.vllm_engines import lmcache_transfer_config

DATA = Path(__file__).parent / "data"
OUT = Path(__file__).parent / "out"
POLICIES = ("round-robin", "session", "kv-aware")
WORKLOADS = ("balanced", "skewed")
SETUPS = ("own", "shared")


@functools.cache
def corpus() -> list[str]:
    return " ".join(p.read_text() for p in sorted(DATA.glob("*.txt"))).split()


def words(start: int, n: int) -> str:
    text = corpus()
    return " ".join(text[(start + i) % len(text)] for i in range(n))


def users_of(workload: str, args: argparse.Namespace) -> list[tuple[int, int]]:
    """(document words, rounds) per user."""
    heavy = {2 * i for i in range(args.heavy)} if workload == "skewed" else set()
    return [(args.doc_words * (args.skew if u in heavy else 1), args.rounds * (2 if u in heavy else 1))
            for u in range(args.users)]


def chat(url: str, user: str, messages: list[dict], answer_tokens: int) -> dict[str, Any]:
    """One streamed chat turn: TTFT, the answer, its usage."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": answer_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "user": user}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Session-ID": user})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with urllib.request.urlopen(request, timeout=900) as response:
        instance = response.headers.get("X-LMCache-Instance")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(content)
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "text": "".join(text),
            "instance": instance, "start": t0, "prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def salt_of(run: int) -> str:
    """Run `run`'s text salt: fixed-width digits, which SmolLM2's tokenizer splits one per token, so
    that every run's texts have the same token counts (`check_salts`). A salt of another length
    moves where the users' shared prefix ends against the engine's blocks: with named salts
    (``own0balancedsession`` vs ``own0balancedkv-aware``) session runs' users shared 256 cached
    tokens and kv-aware runs' 384, which changed how their first prompts were batched."""
    return f"{run:06d}"


def system_text(salt: str, args: argparse.Namespace) -> str:
    return f"Session {salt}. You are a careful assistant. " + words(0, args.system_words)


def check_salts(model: str, args: argparse.Namespace, runs: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = {len(tokenizer(system_text(salt_of(r), args))["input_ids"]) for r in (0, runs - 1)}
    if len(lengths) != 1:
        raise SystemExit(f"run salts tokenize to different lengths {sorted(lengths)}: runs would differ "
                         "in their cached prefixes")


def run_workload(url: str, workload: str, salt: str, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    system = system_text(salt, args)
    turns: list[list[dict]] = [[] for _ in range(args.users)]

    def user(u: int, document: str, rounds: int) -> None:
        time.sleep(0.2 * u)  # then straight to the first request (its text was made before)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"Document {u + 1}:\n{document}\n\nWhat is it about?"}]
        for rnd in range(rounds):
            if rnd:
                # the same for every policy, other in every repeat
                time.sleep(random.Random(f"{rep}/{u}/{rnd}").uniform(0, args.think))
                question = f"Question {rnd + 1}: and what follows from that?"
                messages.append({"role": "user", "content": question})
            out = chat(url, f"{salt}-user{u}", messages, args.answer_tokens)
            messages.append({"role": "assistant", "content": out["text"]})
            turns[u].append(out | {"round": rnd + 1, "user": u})

    t0 = time.perf_counter()
    specs = [(words(args.system_words + 5000 * u, doc_words), rounds)
             for u, (doc_words, rounds) in enumerate(users_of(workload, args))]
    threads = [threading.Thread(target=user, args=(u, *spec)) for u, spec in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    later = sorted(t["ttft"] for turns_u in turns for t in turns_u if t["round"] >= 2)
    done = [t for turns_u in turns for t in turns_u]
    assert len(done) == sum(r for _, r in users_of(workload, args)), "a request failed"
    return {"mean_ttft_round2plus": statistics.mean(later),
            "p90_ttft_round2plus": later[min(len(later) - 1, round(0.9 * (len(later) - 1)))],
            "throughput_tokens_per_s": sum(t["completion_tokens"] for t in done) / wall, "wall_s": wall,
            "served_cached_tokens": sum(t["cached_tokens"] for t in done),
            "turns": [{k: v for k, v in t.items() if k != "text"} | {"start": t["start"] - t0} for t in done]}


class Router:
    def __init__(self, policy: str, instances: list[OpenAIServer], events: list[int], model: str,
                 log: Path, shared_events: str = "") -> None:
        """`policy`: a policy's name, or ``kv-aware@N`` for kv-aware with ``--request-cost N``."""
        name, _, cost = policy.partition("@")
        self.port = free_port()
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.cli", "router", "--policy", name, "--port", str(self.port),
             *(("--request-cost", cost) if cost else ()),
             "--instance", ",".join(s.url("") for s in instances), "--model", model,
             "--kv-events", ",".join(f"tcp://127.0.0.1:{p}" for p in events),
             "--shared-kv-events", shared_events],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
        wait_port(self.port, 120)
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        return json.loads(urllib.request.urlopen(f"{self.url}/stats", timeout=10).read())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def sources(instances: list[OpenAIServer]) -> dict[str, float]:
    """The instances' prompt tokens by source (vLLM's counters) and LMCache's chunk hits by tier."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {src: sum(metric(s.url(""), "vllm:prompt_tokens_by_source_total", source=src) for s in instances)
           for src in PROMPT_SOURCES}
    for server in instances:
        text = urllib.request.urlopen(server.url("/metrics"), timeout=30).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "lmcache:tier_hits_total":
                    key = f"lmcache_chunk_hits_{sample.labels.get('tier', '?')}"
                    out[key] = out.get(key, 0) + sample.value
    return out


def run_setup(setup: str, args: argparse.Namespace, model: str, scratch: Path, results: list[dict]) -> None:
    cache = None
    shared_events = ""
    if setup == "shared":
        shared_events = f"ipc://{scratch}/cache-events.sock"
        cache = CacheServerProcess(f"ipc://{scratch}/cache.sock", "--kv-events", shared_events,
                                   size_gb=args.lmcache_gb).start()
        transfer = lmcache_transfer_config(cache_server_url=cache.url)
    else:
        transfer = lmcache_transfer_config(max_local_cpu_size=args.lmcache_gb)
    events = [free_port(), free_port()]
    instances = []
    try:
        for i in range(2):
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events[i]}"}
            instances.append(OpenAIServer(
                model, transfer, str(scratch / f"{setup}-vllm{i}.log"), max_model_len=args.max_model_len,
                kv_bytes=args.kv_tokens * 2 * 30 * 3 * 64 * 4, cpus=str(i % (os.cpu_count() or 1)),
                extra_args=("--kv-events-config", json.dumps(config), "--enable-prompt-tokens-details"),
                nice=args.engine_nice))
        routers = {p: Router(p, instances, events, model, scratch / f"{setup}-router-{p}.log", shared_events)
                   for p in args.policies}
        for i, server in enumerate(instances):  # warm: no run meets a fresh instance (and the routers
            # learn each instance's block size from its first events)
            chat(server.url(""), "warm-up", [{"role": "user", "content": words(90_000 + 500 * i, 300)}], 4)
        try:
            for rep in range(args.repeats):
                for workload in args.workloads:
                    for policy in args.policies:  # interleaved
                        before, stats0 = sources(instances), routers[policy].stats()
                        run = run_workload(routers[policy].url, workload, salt_of(len(results)), args, rep)
                        after, stats1 = sources(instances), routers[policy].stats()
                        run |= {"setup": setup, "workload": workload, "policy": policy, "repeat": rep,
                                "prompt_tokens_by_source": {k: after[k] - before.get(k, 0) for k in after},
                                "router_predicted_hit_tokens": stats1["predicted_hit_tokens"]
                                - stats0["predicted_hit_tokens"],
                                "router_served_hit_tokens": stats1["served_hit_tokens"]
                                - stats0["served_hit_tokens"],
                                "sent": {u: v["sent"] - stats0["instances"][u]["sent"]
                                         for u, v in stats1["instances"].items()}}
                        results.append(run)
                        print(f"{setup:<7}{workload:<9}{policy:<12} rep {rep}: mean TTFT r2+ "
                              f"{run['mean_ttft_round2plus']:.3f}s p90 {run['p90_ttft_round2plus']:.3f}s "
                              f"{run['throughput_tokens_per_s']:.1f} tok/s sent {list(run['sent'].values())}",
                              flush=True)
        finally:
            for router in routers.values():
                router.stop()
    finally:
        for server in instances:
            server.stop()
        if cache is not None:
            cache.stop()


def summarize(results: list[dict]) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    for run in results:
        cells.setdefault(f"{run['setup']}/{run['workload']}/{run['policy']}", []).append(run)
    table = {}
    for key, runs in cells.items():
        med = {m: statistics.median(r[m] for r in runs) for m in
               ("mean_ttft_round2plus", "p90_ttft_round2plus", "throughput_tokens_per_s")}
        predicted = sum(r["router_predicted_hit_tokens"] for r in runs)
        served = sum(r["router_served_hit_tokens"] for r in runs)
        med["predicted_vs_served_hits"] = predicted / served if served else None
        med["prompt_tokens_by_source"] = {
            k: sum(r["prompt_tokens_by_source"].get(k, 0) for r in runs) / len(runs)
            for k in runs[0]["prompt_tokens_by_source"]}
        table[key] = med
    print(f"\n{'setup/workload/policy':<32}{'mean r2+':>10}{'p90 r2+':>10}{'tok/s':>8}{'pred/served':>12}"
          f"  prompt tokens by source (per run)")
    for key, m in table.items():
        ratio = "n/a" if m["predicted_vs_served_hits"] is None else f"{m['predicted_vs_served_hits']:.3f}"
        print(f"{key:<32}{m['mean_ttft_round2plus']:>9.3f}s{m['p90_ttft_round2plus']:>9.3f}s"
              f"{m['throughput_tokens_per_s']:>8.1f}{ratio:>12}  "
              + ", ".join(f"{k} {v:.0f}" for k, v in m["prompt_tokens_by_source"].items()))

    def ratio(a: str, b: str) -> float | None:
        if a in table and b in table:
            return table[a]["mean_ttft_round2plus"] / table[b]["mean_ttft_round2plus"]
        return None

    goals = {
        "balanced: kv-aware / session (goal <= 1)": ratio("own/balanced/kv-aware", "own/balanced/session"),
        "skewed: kv-aware / session (goal <= 0.8)": ratio("own/skewed/kv-aware", "own/skewed/session"),
        "round-robin: shared / own (goal <= 0.6)": ratio("shared/balanced/round-robin",
                                                         "own/balanced/round-robin"),
    }
    for setup in SETUPS:  # each kv-aware variant against session affinity on the same setup
        for workload in WORKLOADS:
            for key in table:
                if key.startswith(f"{setup}/{workload}/kv-aware"):
                    goals[f"{key} / {setup}/{workload}/session"] = ratio(key, f"{setup}/{workload}/session")
    for workload in WORKLOADS:
        best = min((k for k in table if f"/{workload}/" in k), key=lambda k: table[k]["mean_ttft_round2plus"],
                   default=None)
        goals[f"{workload}: fastest (goal shared/{workload}/kv-aware)"] = best
    print()
    for name, value in goals.items():
        print(f"{name}: {value if not isinstance(value, float) else f'{value:.2f}x'}")
    return {"cells": table, "goals": goals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 users x 2 rounds, short texts, "
                        "one repeat, own tiers only")
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--doc-words", type=int, default=700)
    parser.add_argument("--skew", type=int, default=2, help="skewed: the heavy users' document, x doc-words")
    parser.add_argument("--heavy", type=int, default=None,
                        help="skewed: how many users are heavy (users 0, 2, 4, ...; default: half)")
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--think", type=float, default=0.0,
                        help="each user waits a random 0..THINK s before each later round (seeded by repeat, "
                             "user and round: the same for every policy, other in every repeat)")
    parser.add_argument("--engine-nice", type=int, default=5,
                        help="the vLLM instances' niceness (their sessions' too, where the kernel groups "
                             "sessions for its scheduler; before 260d1c3 only the processes'): the engines "
                             "take every core, and at the same priority the users' threads (and the "
                             "router) woke late from their pauses, so that runs of one workload met "
                             "different arrivals")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated; kv-aware@N is kv-aware with --request-cost N")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="each vLLM's KV pool, in tokens")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--lmcache-gb", type=float, default=1.0, help="each hot tier / the cache server's L1")
    args = parser.parse_args()
    if args.quick:
        args.users, args.rounds, args.system_words, args.doc_words, args.answer_tokens = 2, 2, 60, 120, 4
        args.repeats, args.setups, args.max_model_len = 1, "own", 2048
    every_other = (args.users + 1) // 2  # users 0, 2, 4, ...
    args.heavy = every_other if args.heavy is None else args.heavy
    if not 0 <= args.heavy <= every_other:
        parser.error(f"--heavy: 0 to {every_other} (every other user of --users {args.users})")
    for name, allowed in (("setups", SETUPS), ("workloads", WORKLOADS), ("policies", POLICIES)):
        chosen = tuple(getattr(args, name).split(","))
        if {c.partition("@")[0] for c in chosen} - set(allowed) \
                or not all(c.partition("@")[2].isdigit() for c in chosen if "@" in c):
            parser.error(f"--{name}: choose from {', '.join(allowed)} (policies: kv-aware@N too)")
        setattr(args, name, chosen)

    from lmcache.integration.local_model import local_model_path

    model = local_model_path("float32")
    check_salts(model, args, len(args.setups) * args.repeats * len(args.workloads) * len(args.policies))
    scratch = Path(tempfile.mkdtemp(prefix="lmcache-fleet-"))
    t0 = time.perf_counter()
    results: list[dict] = []
    try:
        for setup in args.setups:
            run_setup(setup, args, model, scratch, results)
    finally:
        print(f"logs in {scratch}")
    summary = summarize(results)
    OUT.mkdir(exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
               f"{os.cpu_count()} cpus", "args": {k: v for k, v in vars(args).items()}, "summary": summary,
               "runs": results, "wall_s": time.perf_counter() - t0}
    (OUT / "fleet_routing.json").write_text(json.dumps(payload, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {OUT / 'fleet_routing.json'} ({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
