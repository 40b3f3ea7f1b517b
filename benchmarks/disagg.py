"""Prefill/decode disaggregation under load: 1P1D (a prefill and a decode vLLM-CPU instance, one
core each, LMCache moving the KV, `lmcache proxy` in front) vs one instance on both cores, and vs
vLLM's own NixlConnector 1P1D (same cores, the same proxy with ``--kv-protocol nixl``).

The workload (LMCache's long-document style): `--decoders` requests with short prompts stream
`--decode-tokens` tokens each (``ignore_eos``) from t=0, and `--long` requests with
`--long-tokens`-token documents arrive while they decode (t = 1 s, then every `--gap` s), each
asking for 16 tokens. Measured per trial, as a client sees it (streamed completions over HTTP):
the inter-token latency of the decoding requests (gaps between their streamed tokens), the long
requests' TTFT, and output tokens per second over the trial. Trials alternate between the set-ups
(`--trials` each, new prompts per trial, the same prompts for every set-up, the order rotating);
the instances of the set-ups not being measured stay up and idle, but NixlConnector's run only
for their own measurements (its NIXL agents keep a core busy each even when idle, which would
slow whatever runs beside them).
Also checked: every answer of each 1P1D equals the single instance's (greedy, fp32), LMCache's
decoder computed at most one prompt token per request (vLLM's own ``prompt_tokens_by_source``),
and the KV the prefiller sent equals the prompts' KV bytes.

Then the repeated prefix, per set-up, alone: a document is asked, then enough other documents to
fill vLLM's KV cache (1 GiB) 1.5 times over, then the document again with another question: the
repeat's TTFT, and where the prefiller's prompt tokens for it came from (computed, vLLM's prefix
cache, or the connector). LMCache's instances keep 3 GB of KV in their CPU tier.

    python benchmarks/disagg.py [--trials 3] [--channel nixl|tcp] [--no-nixl-connector] [--no-repeat]
                                [--long N --gap S --decode-tokens N] [--tag TAG]

Goals (issue 24): p90 ITL of 1P1D <= 0.5x the single instance's; TTFT and ITL no worse than
NixlConnector's, and the repeated prefix served from cache. Writes benchmarks/out/disagg.json
(disagg-TAG.json with `--tag`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from machine import cpu_info, cpu_line

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lmcache.integration.local_model import local_model_path  # noqa: E402
from tests.helpers.openai_server import MODEL_NAME, OpenAIServer, metric, prompt_sources  # noqa: E402
from tests.helpers.servers import free_port, wait_port  # noqa: E402
from tests.helpers.vllm_engines import (  # noqa: E402
    kv_bytes_per_token,
    lmcache_transfer_config,
    nixl_connector_config,
    sentence_text,
)

OUT = Path(__file__).parent / "out"


@dataclass
class Stream:
    text: str = ""
    ttft: float = 0.0
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0


async def stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                 ignore_eos: bool) -> Stream:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    out = Stream()
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                out.prompt_tokens = event["usage"]["prompt_tokens"]
            for choice in event.get("choices", []):
                now = time.perf_counter()
                if not out.token_times:
                    out.ttft = now - t0
                out.token_times.append(now)
                out.text += choice["text"]
    return out


def document(trial: int, j: int, args: argparse.Namespace) -> str:
    return sentence_text(1000 * trial + 500 + j, int(args.long_tokens / 1.15))


def prompts(trial: int, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    short = [sentence_text(1000 * trial + i, 250) + " Tell the story." for i in range(args.decoders)]
    long = [document(trial, j, args) + " Summarize." for j in range(args.long)]
    return short, long


def since(url: str, before: dict[str, float]) -> dict[str, float]:
    return {src: n - before[src] for src, n in prompt_sources(url).items()}


async def one(url: str, prompt: str, max_tokens: int = 16) -> Stream:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await stream(session, url, prompt, max_tokens, False)


async def workload(url: str, short: list[str], long: list[str], args: argparse.Namespace) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        t0 = time.perf_counter()

        async def late(prompt: str, delay: float) -> Stream:
            await asyncio.sleep(delay)
            return await stream(session, url, prompt, 16, False)

        decoding = [stream(session, url, p, args.decode_tokens, True) for p in short]
        arriving = [late(p, 1.0 + j * args.gap) for j, p in enumerate(long)]
        results = await asyncio.gather(*decoding, *arriving)
        seconds = time.perf_counter() - t0
    dec, lng = results[: len(short)], results[len(short):]
    gaps = [b - a for s in dec for a, b in zip(s.token_times, s.token_times[1:])]
    tokens = sum(len(s.token_times) for s in results)
    return {"itl_p50": statistics.median(gaps), "itl_p90": statistics.quantiles(gaps, n=10)[-1],
            "itl_max": max(gaps), "long_ttft": [s.ttft for s in lng],
            "long_ttft_p90": max(s.ttft for s in lng) if len(lng) < 3 else statistics.quantiles(
                [s.ttft for s in lng], n=10)[-1],
            "throughput_tok_s": tokens / seconds, "seconds": seconds,
            "texts": [s.text for s in results], "prompt_tokens": [s.prompt_tokens for s in results]}


@dataclass
class SetUp:
    """A deployment under test: its vLLM instances (role -> (KV transfer config, cores, more
    environment)), and for 1P1D the `lmcache proxy` arguments naming its KV hand-off. A `transient`
    set-up is started for each of its measurements and stopped after it: NixlConnector's NIXL
    agents keep a core busy each even when idle, which would slow whatever runs beside them."""

    name: str
    instances: dict[str, tuple[dict | None, str, dict[str, str]]]
    proxy_args: list[str] | None = None
    transient: bool = False
    servers: dict[str, OpenAIServer] = field(default_factory=dict)
    proxy: subprocess.Popen | None = None
    url: str = ""

    def up(self, model: str, logs: Path, warm: Callable[[str], None]) -> None:
        if self.servers:
            return
        with ThreadPoolExecutor(len(self.instances)) as pool:
            futures = {role: pool.submit(OpenAIServer, model, cfg, str(logs / f"{self.name}-{role}.log"),
                                         max_model_len=8192, kv_bytes=KV_BYTES, cpus=cpus, env=env)
                       for role, (cfg, cpus, env) in self.instances.items()}
            self.servers = {role: f.result() for role, f in futures.items()}
        if self.proxy_args is None:
            self.url = self.servers["single"].url("")
        else:
            port = free_port()
            command = [sys.executable, "-m", "lmcache.cli", "proxy", "--port", str(port), "--prefiller",
                       self.servers["prefiller"].url(""), "--decoder", self.servers["decoder"].url(""),
                       *self.proxy_args]
            log = open(logs / f"{self.name}-proxy.log", "ab")
            self.proxy = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            wait_port(port, 30)
            self.url = f"http://127.0.0.1:{port}"
        warm(self.url)

    def down(self, force: bool = False) -> None:
        if not (self.transient or force):
            return
        if self.proxy is not None:
            self.proxy.terminate()
            self.proxy.wait()
            self.proxy = None
        for server in self.servers.values():
            server.stop()
        self.servers = {}

    def prefiller(self) -> str:
        return self.servers["single" if self.proxy_args is None else "prefiller"].url("")


KV_BYTES = 1 << 30  # vLLM's KV cache of every instance


def add(total: dict[str, float], more: dict[str, float]) -> None:
    for key, value in more.items():
        total[key] = total.get(key, 0.0) + value


def repeat_document(setup: SetUp, args: argparse.Namespace, doc_kv_bytes: int) -> dict:
    """A document asked, then enough other documents to fill vLLM's KV cache 1.5 times over (each
    prefilled, one token; vLLM evicts a request's prefix blocks last), then the document again
    with another question: the repeat's TTFT and where the prefiller's prompt tokens for it came
    from."""
    doc = document(900, 0, args)
    first = asyncio.run(one(setup.url, doc + " Summarize."))
    for k in range(int(1.5 * KV_BYTES / doc_kv_bytes) + 1):
        asyncio.run(one(setup.url, document(901 + k, 0, args) + " Summarize.", max_tokens=1))
    before = prompt_sources(setup.prefiller())
    again = asyncio.run(one(setup.url, doc + " What is it about?"))
    return {"first_ttft": first.ttft, "repeat_ttft": again.ttft, "texts": [first.text, again.text],
            "prefiller": since(setup.prefiller(), before)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--channel", choices=("nixl", "tcp"), default="nixl")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=300)
    ap.add_argument("--long", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--gap", type=float, default=4.0)
    ap.add_argument("--no-nixl-connector", dest="nixl_connector", action="store_false",
                    help="leave out vLLM's NixlConnector 1P1D")
    ap.add_argument("--no-repeat", dest="repeat", action="store_false",
                    help="leave out the repeated document (the trials only)")
    ap.add_argument("--tag", default="", help="write benchmarks/out/disagg-TAG.json (default disagg.json)")
    args = ap.parse_args()
    model = local_model_path("float32")
    logs = OUT / "disagg-logs"
    logs.mkdir(parents=True, exist_ok=True)
    kv_port = free_port()
    pd = {"chunk_size": 256, "transfer_channel": args.channel, "max_local_cpu_size": 3}
    sender = lmcache_transfer_config(enable_pd=True, pd_role="sender", **pd)
    receiver = lmcache_transfer_config(enable_pd=True, pd_role="receiver", pd_peer_init_port=kv_port, **pd)
    setups = [
        SetUp("single", {"single": (None, "0-1", {})}),
        SetUp("1P1D", {"prefiller": (sender, "0", {}), "decoder": (receiver, "1", {})},
              ["--decoder-kv", f"127.0.0.1:{kv_port}"]),
    ]
    if args.nixl_connector:
        setups.append(SetUp("Nixl1P1D", {
            role: (nixl_connector_config(kv_role), cpus, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
            for role, kv_role, cpus in (("prefiller", "kv_producer", "0"), ("decoder", "kv_consumer", "1"))},
            ["--kv-protocol", "nixl"], transient=True))
    per_token = kv_bytes_per_token(model)
    warm_prompts = prompts(99, argparse.Namespace(**{**vars(args), "long_tokens": 600, "long": 1,
                                                     "decoders": 1}))
    warm_args = argparse.Namespace(**{**vars(args), "decode_tokens": 8})

    def warm(url: str) -> None:
        asyncio.run(workload(url, *warm_prompts, warm_args))

    print(f"CPU: {cpu_line()}; set-ups: {', '.join(s.name for s in setups)}", flush=True)
    runs: dict[str, list[dict]] = {s.name: [] for s in setups}
    decoded: dict[str, dict[str, float]] = {s.name: {} for s in setups if s.proxy_args is not None}
    sent = 0.0
    repeats: dict[str, dict] = {}
    try:
        for trial in range(args.trials):
            short, long = prompts(trial, args)
            for setup in setups[trial % len(setups):] + setups[: trial % len(setups)]:
                setup.up(model, logs, warm)
                decoder = setup.servers.get("decoder")
                before = prompt_sources(decoder.url("")) if decoder else {}
                lmcache = setup.name == "1P1D"
                sent_before = metric(setup.prefiller(), "lmcache:pd_sent_bytes_total") if lmcache else 0
                row = asyncio.run(workload(setup.url, short, long, args))
                if decoder:
                    add(decoded[setup.name], since(decoder.url(""), before))
                if lmcache:
                    sent += metric(setup.prefiller(), "lmcache:pd_sent_bytes_total") - sent_before
                setup.down()
                runs[setup.name].append(row)
                ttfts = ", ".join(f"{t:.2f}" for t in row["long_ttft"])
                print(f"trial {trial} {setup.name:8}: ITL p50 {row['itl_p50'] * 1e3:6.1f} ms  p90 "
                      f"{row['itl_p90'] * 1e3:7.1f} ms  max {row['itl_max'] * 1e3:7.1f} ms   long TTFT "
                      f"{ttfts} s   {row['throughput_tok_s']:.1f} tok/s", flush=True)
        for setup in setups if args.repeat else []:
            setup.up(model, logs, warm)
            repeats[setup.name] = repeat_document(setup, args, int(args.long_tokens * per_token))
            setup.down()
            r = repeats[setup.name]
            print(f"repeated document {setup.name:8}: TTFT first {r['first_ttft']:.3f} s, again "
                  f"{r['repeat_ttft']:.3f} s; the prefiller's prompt tokens for it: "
                  f"{ {k: int(v) for k, v in r['prefiller'].items()} }", flush=True)
    finally:
        for setup in setups:
            setup.down(force=True)
    prompt_tokens = sum(sum(r["prompt_tokens"]) for r in runs["1P1D"])
    n_requests = sum(len(r["prompt_tokens"]) for r in runs["1P1D"])
    identical = {name: [a["texts"] for a in runs["single"]] == [b["texts"] for b in rows]
                 and (not repeats or repeats["single"]["texts"] == repeats[name]["texts"])
                 for name, rows in runs.items() if name != "single"}
    med = {name: {k: statistics.median(r[k] for r in rows) for k in ("itl_p50", "itl_p90", "long_ttft_p90",
                                                                    "throughput_tok_s")}
           for name, rows in runs.items()}
    ratio = med["1P1D"]["itl_p90"] / med["single"]["itl_p90"]
    computed = decoded["1P1D"]["local_compute"]
    summary = {
        "identical_answers": identical, "requests": n_requests, "decoder_prompt_tokens": decoded,
        "kv_sent_bytes": sent, "prompt_kv_bytes": prompt_tokens * per_token,
        "itl_p90_ratio": ratio, "medians": med,
        "repeats": {name: {k: v for k, v in r.items() if k != "texts"} for name, r in repeats.items()},
    }
    print(f"\nmedians of {args.trials} trials (channel {args.channel}):")
    for name, m in med.items():
        print(f"  {name:8}: ITL p50 {m['itl_p50'] * 1e3:6.1f} ms, p90 {m['itl_p90'] * 1e3:7.1f} ms; "
              f"long TTFT p90 {m['long_ttft_p90']:.2f} s; {m['throughput_tok_s']:.1f} tok/s"
              + (f"; repeated document TTFT {repeats[name]['repeat_ttft']:.3f} s" if repeats else ""))
    print(f"  p90 ITL 1P1D / single: {ratio:.2f} (goal <= 0.5)  answers identical to single: {identical}")
    print(f"  LMCache decoder computed {computed:.0f} prompt tokens for {n_requests} requests (<= 1 each); "
          f"KV sent {sent / 1e6:.1f} MB = prompts' KV {prompt_tokens * per_token / 1e6:.1f} MB: "
          f"{sent == prompt_tokens * per_token}")
    for name, sources in decoded.items():
        print(f"  {name} decoder's prompt tokens in the trials: { {k: int(v) for k, v in sources.items()} }")
    (OUT / f"disagg{'-' + args.tag if args.tag else ''}.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), **cpu_info(), "args": vars(args),
         "runs": {k: [{x: y for x, y in r.items() if x != "texts"} for r in v] for k, v in runs.items()},
         **summary}, indent=2))


if __name__ == "__main__":
    main()
