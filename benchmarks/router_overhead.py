"""What `lmcache router` adds to a request's time: a client asks a backend directly and through the
router, interleaved request by request, and the medians are compared.

The backend is a small OpenAI-shaped aiohttp server in a process of its own that answers at once
(no model: what is left is the router's relay): a completion streamed in --chunks SSE events, or
whole (--gap seconds between a stream's events, as a model's tokens come; 0: back to back, in as
few reads as TCP makes of them). The router (``round-robin``, one instance) runs as ``lmcache
router`` in its own process, as users run it; the client is this process (aiohttp, one request at
a time). Reported per answer kind: the median time of a request (whole, to its last byte), direct
and through the router, their difference and ratio.

    python benchmarks/router_overhead.py [--requests 300] [--chunks 200] [--gap 0.001]

Writes benchmarks/out/router_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine import cpu_line  # noqa: E402
from tests.helpers.servers import free_port, wait_port  # noqa: E402

BACKEND = """
import asyncio, json, sys
from aiohttp import web

CHUNKS, GAP = int(sys.argv[2]), float(sys.argv[3])

async def complete(request):
    body = await request.json()
    if not body.get("stream"):
        return web.json_response({"choices": [{"text": "x" * CHUNKS}], "usage": {"prompt_tokens": 9}})
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for i in range(CHUNKS):
        await out.write(f"data: {json.dumps({'choices': [{'text': 'x', 'index': i}]})}\\n\\n".encode())
        if GAP:
            await asyncio.sleep(GAP)  # tokens one by one: each event its own read
    await out.write(b"data: [DONE]\\n\\n")
    return out

app = web.Application()
app.router.add_post("/v1/completions", complete)
app.router.add_get("/health", lambda request: web.Response(text=""))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


async def timed(session: aiohttp.ClientSession, url: str, stream: bool) -> float:
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json={"prompt": "hi", "stream": stream}) as r:
        assert r.status == 200, r.status
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter() - started


async def measure(direct: str, routed: str, requests: int) -> dict[str, dict[str, float]]:
    out = {}
    async with aiohttp.ClientSession() as session:
        for stream in (True, False):
            times: dict[str, list[float]] = {"direct": [], "router": []}
            for _ in range(20):  # warm both paths' connections
                await timed(session, direct, stream)
                await timed(session, routed, stream)
            for _ in range(requests):
                times["direct"].append(await timed(session, direct, stream))
                times["router"].append(await timed(session, routed, stream))
            d, r = statistics.median(times["direct"]), statistics.median(times["router"])
            out["stream" if stream else "whole"] = {"direct_ms": d * 1e3, "router_ms": r * 1e3,
                                                    "added_ms": (r - d) * 1e3, "ratio": r / d}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--gap", type=float, default=0.0, help="seconds between a stream's events")
    args = ap.parse_args()
    backend_port, router_port = free_port(), free_port()
    backend = subprocess.Popen([sys.executable, "-c", BACKEND, str(backend_port), str(args.chunks),
                                str(args.gap)])
    router = subprocess.Popen([sys.executable, "-m", "lmcache.cli", "router", "--port", str(router_port),
                               "--instance", f"http://127.0.0.1:{backend_port}"], cwd=REPO,
                              stderr=subprocess.DEVNULL)
    try:
        wait_port(backend_port, 60, backend)
        wait_port(router_port, 60, router)
        results = asyncio.run(measure(f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{router_port}",
                                      args.requests))
    finally:
        for proc in (router, backend):
            proc.terminate()
            proc.wait(30)
    print(cpu_line())
    print(f"{args.requests} requests each way, interleaved; a stream of {args.chunks} SSE events, "
          f"{args.gap * 1e3:g} ms apart")
    print("| answer | direct (median) | through the router | added | ratio |")
    print("|---|---|---|---|---|")
    for kind, r in results.items():
        print(f"| {kind} | {r['direct_ms']:.2f} ms | {r['router_ms']:.2f} ms | {r['added_ms']:.2f} ms | "
              f"{r['ratio']:.2f}x |")
    out = REPO / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    (out / "router_overhead.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
