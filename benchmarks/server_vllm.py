"""Two vLLM-CPU instances on one cache server: is instance B's first request for a 4k-token
document that instance A served a full hit, as fast as A's own repeat?

One `lmcache cache-server` (ipc socket, 2 GB L1) and two vLLM OpenAI servers attached to it
(`cache_server_url`; SmolLM2-135M fp32, eager; A bound to core 0, B to core 1, so both run on the
same kind of core). For each of `--docs` documents of about 3,900 tokens (distinct texts): A
answers it first (computed; LMCache stores it into the server's L1), then, after one heartbeat
(1 s: by then B has mapped the arena pages the server has grown, as it does in the background),
in alternating order, A's repeat and B's first request for it. The first `--warmup` documents
are sent the same way but not counted (an instance's first requests pay one-time costs). Every
request streams `--max-tokens` tokens greedily (ignore_eos); TTFT is measured from sending to the
first streamed token. Checked for every
document: the three answers are identical and B computed at most 1 prompt token (vLLM's
``prompt_tokens_by_source``).

Run twice, in one invocation: with vLLM's own prefix cache on (the default: A's repeat is served
from A's KV blocks) and off (`--no-enable-prefix-caching`: A's repeat also comes from the server,
so both sides load the same bytes the same way). Reported per run: median TTFT of A's first
request, A's repeat and B's first request, and B first / A repeat (goal <= 1.2).

    python benchmarks/server_vllm.py [--docs 6] [--warmup 1] [--max-tokens 8]

Writes benchmarks/out/server_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from machine import cpu_info, cpu_line

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lmcache.integration.local_model import local_model_path  # noqa: E402
from tests.helpers.openai_server import OpenAIServer, prompt_sources  # noqa: E402
from tests.helpers.servers import CacheServerProcess  # noqa: E402
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text  # noqa: E402

OUT = Path(__file__).parent / "out"
GOAL = 1.2
HEARTBEAT = 1.0
WORDS = 3400  # about 3,900 SmolLM2 tokens with the question


@dataclass
class Run:
    prefix_cache: bool
    prompt_tokens: list[int] = field(default_factory=list)
    a_first: list[float] = field(default_factory=list)
    a_repeat: list[float] = field(default_factory=list)
    b_first: list[float] = field(default_factory=list)
    b_computed: list[float] = field(default_factory=list)
    identical: bool = True

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))

    @property
    def ratio(self) -> float:
        return self.median("b_first") / self.median("a_repeat")


def measure(prefix_cache: bool, docs: list[str], warmup: int, max_tokens: int, workdir: Path) -> Run:
    model = local_model_path("float32")
    url = f"ipc://{workdir}/cache-{int(prefix_cache)}.sock"
    cache = CacheServerProcess(url, size_gb=2, heartbeat=HEARTBEAT).start()
    extra = () if prefix_cache else ("--no-enable-prefix-caching",)
    transfer = lmcache_transfer_config(cache_server_url=url)
    run = Run(prefix_cache)
    servers: list[OpenAIServer] = []
    try:
        for name, cpus in (("a", "0"), ("b", "1")):
            log = str(workdir / f"{name}-{int(prefix_cache)}.log")
            servers.append(OpenAIServer(model, transfer, log, cpus=cpus, extra_args=extra))
        a, b = servers
        for i, doc in enumerate(docs):
            stored = a.metric("lmcache:stored_tokens_total")
            first = a.complete(doc, max_tokens, ignore_eos=True)
            a.wait_metric("lmcache:stored_tokens_total", stored + first.prompt_tokens - 256)
            time.sleep(HEARTBEAT)
            before = prompt_sources(b.url(""))["local_compute"]
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            got = {who: {"a": a, "b": b}[who].complete(doc, max_tokens, ignore_eos=True) for who in order}
            run.identical &= first.text == got["a"].text == got["b"].text
            if i < warmup:
                continue
            run.b_computed.append(prompt_sources(b.url(""))["local_compute"] - before)
            run.prompt_tokens.append(first.prompt_tokens)
            run.a_first.append(first.ttft)
            run.a_repeat.append(got["a"].ttft)
            run.b_first.append(got["b"].ttft)
    finally:
        for server in servers:
            server.stop()
        cache.stop()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=6, help="documents measured per run")
    parser.add_argument("--warmup", type=int, default=1, help="documents first sent unmeasured, per run")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens streamed per request")
    args = parser.parse_args()
    question = "\nQuestion: what did the engineer measure?"
    docs = [sentence_text(100 + i, WORDS) + question for i in range(args.warmup + args.docs)]
    with tempfile.TemporaryDirectory(prefix="lmcache-server-vllm-") as workdir:
        runs = [measure(on, docs, args.warmup, args.max_tokens, Path(workdir)) for on in (True, False)]
    print(f"\nTwo vLLM-CPU instances (one core each) on one cache server; {cpu_line()}")
    print(f"{args.docs} documents of {min(runs[0].prompt_tokens)}-{max(runs[0].prompt_tokens)} tokens, "
          f"{args.max_tokens} tokens streamed; median TTFT in ms")
    print(f"{'vLLM prefix cache':<20}{'A first':>10}{'A repeat':>10}{'B first':>10}{'B/A repeat':>12}"
          f"{'B computed':>12}{'identical':>11}")
    for run in runs:
        print(f"{'on' if run.prefix_cache else 'off':<20}{run.median('a_first') * 1e3:>10.0f}"
              f"{run.median('a_repeat') * 1e3:>10.1f}{run.median('b_first') * 1e3:>10.1f}{run.ratio:>12.2f}"
              f"{max(run.b_computed):>12.0f}{run.identical!s:>11}")
    print(f"goal: B's first request within {GOAL}x of A's repeat")
    OUT.mkdir(exist_ok=True)
    path = OUT / "server_vllm.json"
    path.write_text(json.dumps({**cpu_info(), "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                                "runs": [{**asdict(r), "ratio": r.ratio} for r in runs]}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
