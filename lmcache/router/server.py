"""`lmcache router`: an OpenAI-compatible front for N vLLM instances that picks one per request by
a policy (`lmcache.router.policies`: ``round-robin``, ``session``, ``kv-aware``).

For ``kv-aware`` the router subscribes to each instance's KV event stream (vLLM's
``--kv-events-config``, ZMQ; `lmcache.router.events`), keeps a `KVIndex` of the blocks each instance
holds and in which tier (and of the prompts sent to it whose answers have not ended: vLLM caches
their blocks before it publishes them), and tokenizes each request with the model's tokenizer (``model``,
`lmcache.router.tokens`) to match it against the index. With a tokenizer the router also predicts,
for any policy, the prompt tokens the chosen instance has cached, and compares that to what the
instance served from cache: the answer's ``usage.prompt_tokens_details.cached_tokens`` (vLLM gives
it with ``--enable-prompt-tokens-details``; for a stream, with ``stream_options.include_usage``).

Faults: an instance that cannot be reached (or breaks off before anything reached the client) is
marked down, its index entries forgotten, and the request retried on the next instance the policy
ranks; a down instance's ``/health`` is probed every ``probe_interval`` seconds and it is back when
it answers 200. An instance that stops answering without closing its connections (a stopped or
hung process): each ``stall_timeout`` seconds a request waits for its answer (or a stream for its
next chunk), the instance's ``/health`` is probed (one probe per instance, shared by the requests
waiting on it); one that does not answer 200 within ``health_timeout`` is marked down as above.
A stream that breaks off after its first chunk ends with an SSE error event. When no instance
answers: 503.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the answer's
``X-LMCache-Instance`` header names the instance that gave it), ``GET /v1/models``,
``GET /health`` (200 when an instance is up), ``GET /stats`` (JSON: counters, decisions per instance,
predicted vs served hit tokens, the index and the event subscribers), ``GET /metrics``
(Prometheus text of the same).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from lmcache.kv_events import check_endpoints
from lmcache.observability import Counters
from lmcache.router.http import (
    ClientSession,
    StallWatch,
    base_url,
    error_response,
    health_of,
    json_object,
    new_app,
    passed_on,
    relay_stream,
    relayed,
    serve,
    session_of,
    sse_error,
)
from lmcache.router.index import TIER_WEIGHTS
from lmcache.router.policies import POLICIES, REQUEST_COST, Instance, Policy, Routed
from lmcache.router.tokens import request_keys
from lmcache.router.watch import KVWatch

logger = logging.getLogger(__name__)

INSTANCE_HEADER = "X-LMCache-Instance"  # names the instance that answered a completion
COUNTERS = ("requests", "bad_requests", "retries", "instance_failures", "unanswered", "hits_compared",
            "predicted_hit_tokens", "served_hit_tokens")


@dataclass
class RouterConfig:
    """`kv_events[i]` is the ZMQ endpoint of `instances[i]`'s KV events (``tcp://HOST:PORT`` where
    the instance publishes them, or ``ipc://``; ``kv-aware`` needs them and `model`, the
    tokenizer's folder); `shared_kv_events` those of cache servers every instance is attached to
    (``lmcache cache-server --kv-events``): what they hold counts as cached on every instance,
    beyond the instance's own prefix. Every value is checked here (ValueError); `Router` raises
    ValueError too for an endpoint ZMQ cannot subscribe to."""

    instances: tuple[str, ...]
    policy: str = "round-robin"
    kv_events: tuple[str, ...] = ()
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    request_cost: int = REQUEST_COST
    max_blocks: int = 200_000
    tier_weights: dict[str, float] = field(default_factory=lambda: dict(TIER_WEIGHTS))
    probe_interval: float = 1.0
    health_timeout: float = 2.0
    shared_kv_events: tuple[str, ...] = ()
    stall_timeout: float = 10.0  # seconds with no answer (or next chunk) before /health is probed

    def __post_init__(self) -> None:
        self.instances = tuple(base_url("instances", url) for url in self.instances)
        if not self.instances:
            raise ValueError("instances: at least one is needed")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: expected one of {', '.join(POLICIES)} (or pd)")
        if self.kv_events and len(self.kv_events) != len(self.instances):
            raise ValueError(f"kv_events: {len(self.kv_events)} endpoint(s) for {len(self.instances)} "
                             "instance(s); give one per instance, in the same order")
        check_endpoints(self.kv_events + self.shared_kv_events, connect=True)
        if POLICIES[self.policy].uses_tokens and not (self.kv_events and self.model):
            raise ValueError(f"policy {self.policy} needs kv_events (one per instance) and model")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port}: must be a TCP port (0 = any free one)")
        for name in ("probe_interval", "health_timeout", "stall_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")
        if self.request_cost < 0:
            raise ValueError(f"request_cost={self.request_cost}: must be >= 0")
        if self.max_blocks <= 0:
            raise ValueError(f"max_blocks={self.max_blocks}: must be > 0")
        for medium, weight in self.tier_weights.items():
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"tier weight {medium}={weight}: must be a finite number >= 0")


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.watch = KVWatch(config.instances, config.kv_events, config.model, config.max_blocks,
                             config.tier_weights, config.shared_kv_events)
        self.index = self.watch.index
        self.instances = [Instance(url) for url in config.instances]
        self.policy: Policy = POLICIES[config.policy](self.watch, config.request_cost)
        self.counters = Counters()
        self.client = ClientSession()
        self.stalls = StallWatch(self.client, config.stall_timeout, config.health_timeout)

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        """Probes down instances while the app runs; closes the subscribers after."""
        probe = asyncio.create_task(self._probe())
        yield
        probe.cancel()
        self.watch.close()

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval)
            for inst in self.instances:
                if not inst.up and await health_of(self.client.session, inst.url, self.config.health_timeout):
                    inst.up = True
                    logger.info("instance %s answers again", inst.url)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.counters.add("requests")
        raw = await request.read()
        try:
            body = json_object(raw)
        except ValueError as e:
            self.counters.add("bad_requests")
            return error_response(400, str(e))
        tokens = await self.watch.tokens(request.path, body)
        routed = Routed(session_of(request, body), tokens, request_keys(body))
        tried: set[str] = set()
        while True:
            untried = [i for i in self.instances if i.url not in tried]
            live = [i for i in untried if i.up] or untried  # all down: try them anyway
            if not live:
                self.counters.add("unanswered")
                return error_response(503, f"no instance answered (tried {', '.join(sorted(tried))})")
            inst = self.policy.rank(routed, live)[0]
            if tried:
                self.counters.add("retries")
            tried.add(inst.url)
            answer = await self._forward(request, inst, raw, routed, bool(body.get("stream")))
            if answer is not None:
                return answer

    async def _forward(self, request: web.Request, inst: Instance, raw: bytes, routed: Routed,
                       stream: bool) -> web.StreamResponse | None:
        """`inst`'s answer relayed, or None if it failed before anything reached the client."""
        predicted = None
        tokens = routed.tokens
        if tokens is not None:
            predicted = self.watch.match(inst.url, tokens, routed.keys).servable(len(tokens))
        uncached = 0 if tokens is None else len(tokens) - (predicted or 0)
        headers = passed_on(request) | {"Content-Type": "application/json"}
        try:
            with inst.serving(uncached) as prefilled, self.watch.sending(inst.url, tokens, routed.keys):
                posted = self.client.session.post(inst.url + request.path, data=raw, headers=headers)
                async with await self.stalls.started(inst.url, posted) as r:
                    if stream and r.status == 200:
                        first = await self.stalls.chunk(inst.url, r.content)
                        if not first:
                            raise aiohttp.ServerDisconnectedError("the stream ended before its first chunk")
                        prefilled()
                        return await relay_stream(request, r, self._chunks(first, r, inst, predicted),
                                                  {INSTANCE_HEADER: inst.url})
                    answer = await self.stalls.body(inst.url, r.content)
        except aiohttp.ClientError as e:
            self._failed(inst, e)
            return None
        if r.status == 200:
            self._compare(predicted, served_hits(answer))
        return relayed(r.status, answer, r.headers.get("Content-Type"), {INSTANCE_HEADER: inst.url})

    async def _chunks(self, first: bytes, answer: aiohttp.ClientResponse, inst: Instance,
                      predicted: int | None) -> AsyncIterator[bytes]:
        served = StreamedHits()
        chunk = first
        try:
            while chunk:
                served.feed(chunk)
                yield chunk
                chunk = await self.stalls.chunk(inst.url, answer.content)
        except aiohttp.ClientError as e:
            self._failed(inst, e)
            yield sse_error(503, f"instance {inst.url} failed: {str(e) or type(e).__name__}")
            return
        self._compare(predicted, served.cached)

    def _failed(self, inst: Instance, error: BaseException) -> None:
        self.counters.add("instance_failures")
        if inst.up:
            logger.warning("instance %s failed (%s): marked down, its requests go to the others", inst.url,
                           str(error) or type(error).__name__)
        inst.up = False
        self.index.forget(inst.url)

    def _compare(self, predicted: int | None, served: int | None) -> None:
        if predicted is not None and served is not None:
            self.counters.add("hits_compared")
            self.counters.add("predicted_hit_tokens", predicted)
            self.counters.add("served_hit_tokens", served)

    async def models(self, request: web.Request) -> web.StreamResponse:
        for inst in sorted(self.instances, key=lambda i: not i.up):
            try:
                got = self.client.session.get(inst.url + request.path, headers=passed_on(request))
                async with await self.stalls.started(inst.url, got) as r:
                    body = await self.stalls.body(inst.url, r.content)
                    return relayed(r.status, body, r.headers.get("Content-Type"))
            except aiohttp.ClientError as e:
                self._failed(inst, e)
        return error_response(503, "no instance answered")

    async def health(self, request: web.Request) -> web.Response:
        instances = [{"url": i.url, "up": i.up} for i in self.instances]
        ok = any(i.up for i in self.instances)
        return web.json_response({"status": "ok" if ok else "unavailable", "policy": self.config.policy,
                                  "instances": instances}, status=200 if ok else 503)

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: int(self.counters.get(name)) for name in COUNTERS}
        out["policy"] = self.config.policy
        out["instances"] = {i.url: {"up": i.up, "sent": i.sent, "in_flight": i.in_flight,
                                    "backlog_tokens": i.backlog, "index_blocks": self.index.blocks(i.url)}
                            for i in self.instances}
        return out | self.watch.counts()

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=prometheus_text(self.snapshot()), content_type="text/plain")


def prometheus_text(stats: dict[str, Any]) -> str:
    lines = []
    for name in COUNTERS:
        lines += [f"# TYPE lmcache_router_{name}_total counter", f"lmcache_router_{name}_total {stats[name]}"]
    per_instance = (("sent", "counter", "_total"), ("in_flight", "gauge", ""), ("index_blocks", "gauge", ""),
                    ("up", "gauge", ""))
    for name, kind, suffix in per_instance:
        lines.append(f"# TYPE lmcache_router_instance_{name}{suffix} {kind}")
        lines += [f'lmcache_router_instance_{name}{suffix}{{instance="{url}"}} {int(values[name])}'
                  for url, values in stats["instances"].items()]
    for name in ("batches", "malformed", "missed"):
        lines.append(f"# TYPE lmcache_router_events_{name}_total counter")
        lines += [f'lmcache_router_events_{name}_total{{endpoint="{ep}"}} {counts[name]}'
                  for ep, counts in stats["events"].items()]
    return "\n".join(lines) + "\n"


def served_hits(answer: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer (a JSON document)."""
    try:
        usage = json.loads(answer).get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, RecursionError, AttributeError):
        return None
    return cached if isinstance(cached, int) else None


class StreamedHits:
    """`served_hits` of a stream fed chunk by chunk as it arrives: read from its complete SSE
    lines (``data: {...}``), so an event split across reads counts; a line longer than
    `MAX_LINE_BYTES` is not read."""

    MAX_LINE_BYTES = 1 << 20

    def __init__(self) -> None:
        self.cached: int | None = None
        self._line = b""  # the start of a line whose end has not arrived

    def feed(self, chunk: bytes) -> None:
        *lines, self._line = (self._line + chunk).split(b"\n")
        if len(self._line) > self.MAX_LINE_BYTES:
            self._line = b""
        for line in lines:
            if line.startswith(b"data:") and b'"prompt_tokens_details"' in line:
                cached = served_hits(line.removeprefix(b"data:"))
                if cached is not None:
                    self.cached = cached


ROUTER = web.AppKey("router", Router)  # the app's router, for tests and embedders


def build_app(config: RouterConfig) -> web.Application:
    router = Router(config)
    app = new_app(router.client)
    app.cleanup_ctx.append(router.lifetime)
    app[ROUTER] = router
    app.router.add_post("/v1/completions", router.generate)
    app.router.add_post("/v1/chat/completions", router.generate)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/stats", router.stats)
    app.router.add_get("/metrics", router.metrics)
    return app


async def start(config: RouterConfig) -> web.AppRunner:
    """Serves in the running event loop until `await runner.cleanup()`."""
    return await serve(build_app(config), config.host, config.port)


def run(config: RouterConfig) -> None:
    """Serves until interrupted (the ``lmcache router`` command)."""
    logger.info("lmcache router on http://%s:%d (policy %s): %s", config.host, config.port, config.policy,
                ", ".join(config.instances))
    web.run_app(build_app(config), host=config.host, port=config.port, print=None, handler_cancellation=True)
