"""`lmcache router` in-process before fake vLLM instances (small aiohttp servers): each policy's
choice (and the prefill/decode front's kv-aware prefiller), a returning prompt sent where the
index says it is cached, a dead instance's requests retried on another and the instance brought
back by its /health, streams relayed with the hits they report."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from lmcache.integration.local_model import local_model_path
from lmcache.kv_events import BlockStored
from lmcache.pd.proxy import PROXY, ProxyConfig
from lmcache.pd.proxy import start as start_pd
from lmcache.router import http
from lmcache.router.server import ROUTER, RouterConfig, build_app
from lmcache.router.tokens import PromptTokenizer
from tests.helpers.aio import async_test
from tests.helpers.servers import free_port

pytestmark = pytest.mark.timeout(300)  # a hang guard; a starved CI lane runs this much slower


class FakeVLLM:
    """Answers completions and chats with its name and ``cached_tokens`` = `cached`, streamed if
    asked (`split_usage`: the usage event written in two parts, a pause between)."""

    def __init__(self, name: str, cached: int = 0, port: int | None = None) -> None:
        self.name, self.cached, self.port = name, cached, port or free_port()
        self.bodies: list[dict] = []
        self.gate: asyncio.Event | None = None  # set: answers wait for it
        self.split_usage = False
        self.freeze_after_first = False  # a stream's first chunk, then nothing more, /health included
        self.frozen = False
        self.health_checks = 0

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.gate is not None:
            await asyncio.wait_for(self.gate.wait(), 30)
        usage = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": self.cached}}
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": self.name}], "usage": usage})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f"data: {json.dumps({'choices': [{'text': self.name}]})}\n\n".encode())
        if self.freeze_after_first:
            self.frozen = True
            await self.thawed.wait()
            return out
        last = f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        for part in (last[:40], last[40:]) if self.split_usage else (last,):
            await out.write(part)
            await asyncio.sleep(0.1 if self.split_usage else 0)
        await out.write(b"data: [DONE]\n\n")
        return out

    async def health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.frozen:
            await self.thawed.wait()
        return web.Response(text="")

    async def __aenter__(self) -> FakeVLLM:
        self.thawed = asyncio.Event()  # set as it stops: a frozen one's handlers end
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.thawed.set()
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Running:
    def __init__(self, config: RouterConfig) -> None:
        self.app = build_app(config)
        self.router = self.app[ROUTER]

    async def __aenter__(self) -> Running:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.close()
        await self.runner.cleanup()

    async def ask(self, prompt: str | list[int], headers: dict | None = None,
                  **extra: Any) -> tuple[int, Any]:
        async with self.http.post(f"http://127.0.0.1:{self.port}/v1/completions", headers=headers,
                                  json={"prompt": prompt, **extra}) as r:
            return r.status, (await r.json() if not extra.get("stream") else await r.text())

    async def get(self, path: str) -> Any:
        async with self.http.get(f"http://127.0.0.1:{self.port}{path}") as r:
            return await r.json()


@async_test
async def test_round_robin_alternates_and_session_sticks():
    async with FakeVLLM("a") as a, FakeVLLM("b") as b:
        async with Running(RouterConfig((a.url, b.url), "round-robin")) as rr:
            names = [(await rr.ask("x"))[1]["choices"][0]["text"] for _ in range(4)]
            assert names == ["a", "b", "a", "b"]
        async with Running(RouterConfig((a.url, b.url), "session")) as s:
            one = [(await s.ask("x", {"X-Session-ID": "u1"}))[1]["choices"][0]["text"] for _ in range(3)]
            two = [(await s.ask("x", user="u2"))[1]["choices"][0]["text"] for _ in range(3)]
            assert len(set(one)) == 1 and len(set(two)) == 1 and one[0] != two[0]
            assert (await s.get("/stats"))["instances"][a.url]["sent"] == 3


@async_test
async def test_kv_aware_sends_a_prompt_where_its_prefix_is_and_counts_predicted_and_served_hits():
    model = local_model_path("float32")
    tokens = PromptTokenizer(model)("/v1/completions", {"prompt": "The old sailor " * 20})
    async with FakeVLLM("a") as a, FakeVLLM("b", cached=32) as b:
        config = RouterConfig((a.url, b.url), "kv-aware", ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), model)
        async with Running(config) as r:
            held = BlockStored(list(range(2)), None, tokens[:32], 16, None, "CPU", None)
            r.router.index.apply(b.url, [held])
            for stream in (False, True):
                status, answer = await r.ask("The old sailor " * 20 + "went home", stream=stream)
                assert status == 200 and "b" in json.dumps(answer)
            stats = await r.get("/stats")
            assert stats["hits_compared"] == 2
            assert stats["predicted_hit_tokens"] == stats["served_hit_tokens"] == 64
            status, answer = await r.ask("nothing cached here")  # a miss: the least loaded, in turn
            assert status == 200
            assert (await r.ask([-1, 1 << 40]))[0] == 200  # ids it cannot hash: a miss, the engine judges


@async_test
async def test_a_prompt_in_flight_is_predicted_as_cached_for_the_next_one_on_its_instance():
    """vLLM caches a prompt's blocks when it schedules it, before their events: while the first
    prompt is in flight, the second (its session's, so the same instance) is predicted to find the
    first one's whole blocks, as the instance then serves them."""
    model = local_model_path("float32")
    tokenize = PromptTokenizer(model)
    first, second = "The old sailor " * 20, "The old sailor " * 20 + "went home"
    ids = [tokenize("/v1/completions", {"prompt": p}) for p in (first, second)]
    common = next((i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y), len(ids[0]))
    expected = min(common, len(ids[0])) // 16 * 16
    assert expected >= 32
    async with FakeVLLM("a", cached=expected) as a, FakeVLLM("b") as b:
        config = RouterConfig((a.url, b.url), "session", ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), model)
        async with Running(config) as r:
            r.router.index.apply(a.url, [BlockStored([7], None, list(range(16)), 16, None, None, None)])
            a.gate = asyncio.Event()
            asked = [asyncio.create_task(r.ask(first, {"X-Session-ID": "u"}))]
            while len(a.bodies) < 1:
                await asyncio.sleep(0.01)
            asked.append(asyncio.create_task(r.ask(second, {"X-Session-ID": "u"})))
            while len(a.bodies) < 2:
                await asyncio.sleep(0.01)
            a.gate.set()
            assert [status for status, _ in await asyncio.gather(*asked)] == [200, 200]
            stats = await r.get("/stats")
            assert (stats["predicted_hit_tokens"], stats["served_hit_tokens"]) == (expected, 2 * expected)
            assert r.router.index.match(a.url, ids[1]).tokens == 0  # nothing in flight any more


@async_test
async def test_kv_aware_counts_a_shared_servers_prefix_on_every_instance_and_names_the_instance():
    """With ``shared_kv_events`` a prefix the cache server holds (under the request's cache_salt) is
    cached on both instances: requests go in turn, each predicted as served; the answer's header
    names the instance that gave it."""
    from lmcache.storage_backend.events import EventKind
    from tests.unit.router.test_shared import keys_of, server_events

    model = local_model_path("float32")
    prompt = "The old sailor " * 20
    tokens = PromptTokenizer(model)("/v1/completions", {"prompt": prompt})
    async with FakeVLLM("a", cached=32) as a, FakeVLLM("b", cached=32) as b:
        config = RouterConfig((a.url, b.url), "kv-aware", ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), model,
                              shared_kv_events=("tcp://127.0.0.1:3",))
        async with Running(config) as r:
            r.router.watch.shared.apply(server_events(EventKind.STORED, keys_of(tokens[:32], "t")))
            answered = []
            for _ in range(4):
                async with r.http.post(f"http://127.0.0.1:{r.port}/v1/completions",
                                       json={"prompt": prompt + "went home", "cache_salt": "t"}) as resp:
                    answered.append((resp.headers["X-LMCache-Instance"],
                                     (await resp.json())["choices"][0]["text"]))
            assert sorted(answered) == sorted([(a.url, "a")] * 2 + [(b.url, "b")] * 2)
            stats = await r.get("/stats")
            assert stats["predicted_hit_tokens"] == stats["served_hit_tokens"] == 4 * 32
            assert stats["index"]["shared_blocks"] == 2
            await r.ask(prompt + "went home", cache_salt="another tenant")
            stats = await r.get("/stats")
            assert (stats["predicted_hit_tokens"], stats["served_hit_tokens"]) == (4 * 32, 5 * 32)


@async_test
async def test_a_dead_instance_is_retried_around_and_comes_back_when_healthy():
    dead = free_port()
    async with FakeVLLM("a") as a:
        config = RouterConfig((f"127.0.0.1:{dead}", a.url), "round-robin", probe_interval=0.1)
        async with Running(config) as r:
            answers = [await r.ask("x") for _ in range(3)]
            assert [x[1]["choices"][0]["text"] for x in answers] == ["a"] * 3
            stats = await r.get("/stats")
            assert stats["instance_failures"] == 1 and stats["retries"] == 1
            assert (await r.get("/health"))["instances"][0]["up"] is False
            async with FakeVLLM("back", port=dead):
                await asyncio.sleep(0.5)
                assert (await r.get("/health"))["instances"][0]["up"] is True
                names = {(await r.ask("x"))[1]["choices"][0]["text"] for _ in range(2)}
                assert names == {"a", "back"}
        async with Running(RouterConfig((f"127.0.0.1:{dead}",))) as r:
            status, answer = await r.ask("x")
            assert status == 503 and "no instance answered" in answer["error"]["message"]
            assert (await r.ask("x", headers={"Content-Type": "application/json"}))[0] == 503


@async_test
async def test_an_instance_that_answers_nothing_is_marked_down_and_its_request_answered_by_another():
    """A stopped process's port: the kernel accepts connections into its backlog, and nothing
    reads or answers them, its /health included."""
    with socket.socket() as stopped:
        stopped.bind(("127.0.0.1", 0))
        stopped.listen(16)
        url = f"127.0.0.1:{stopped.getsockname()[1]}"
        async with FakeVLLM("a") as a:
            config = RouterConfig((url, a.url), "round-robin", stall_timeout=0.3, health_timeout=0.3,
                                  probe_interval=0.1)
            async with Running(config) as r:
                started = time.monotonic()
                status, answer = await r.ask("x")
                assert (status, answer["choices"][0]["text"]) == (200, "a")
                assert time.monotonic() - started < 5
                stats = await r.get("/stats")
                assert (stats["instance_failures"], stats["retries"]) == (1, 1)
                assert (await r.get("/health"))["instances"][0]["up"] is False
                assert [(await r.ask("x"))[1]["choices"][0]["text"] for _ in range(2)] == ["a", "a"]


@async_test
async def test_a_stream_whose_instance_stops_mid_way_ends_with_an_error_event():
    async with FakeVLLM("a") as a, FakeVLLM("b") as b:
        a.freeze_after_first = True
        config = RouterConfig((a.url, b.url), "round-robin", stall_timeout=0.3, health_timeout=0.3,
                              probe_interval=0.1)
        async with Running(config) as r:
            status, text = await r.ask("x", stream=True)
            assert status == 200
            events = [line.removeprefix("data: ") for line in text.split("\n") if line]
            assert json.loads(events[0])["choices"][0]["text"] == "a"
            error = json.loads(events[-1])["error"]
            assert error["code"] == 503 and "/health did not answer" in error["message"]
            assert (await r.get("/health"))["instances"][0]["up"] is False
            assert "b" in (await r.ask("x", stream=True))[1]


@async_test
async def test_a_slow_healthy_instance_is_waited_for_with_one_health_probe_at_a_time():
    async with FakeVLLM("a") as a:
        a.gate = asyncio.Event()
        config = RouterConfig((a.url,), stall_timeout=0.2, health_timeout=1.0)
        async with Running(config) as r:
            asking = [asyncio.ensure_future(r.ask("x", stream=i % 2 == 1)) for i in range(6)]
            await asyncio.sleep(1.5)
            a.gate.set()
            answers = await asyncio.gather(*asking)
            assert [status for status, _ in answers] == [200] * 6
            assert all("a" in str(answer) for _, answer in answers)
            assert 3 <= a.health_checks <= 1.5 / 0.2 + 2  # not one per waiting request
            stats = await r.get("/stats")
            assert (stats["instance_failures"], stats["retries"]) == (0, 0)


def test_the_fronts_start_without_torch():
    """`lmcache router` and `lmcache proxy` import neither torch nor the tiers (torch took 1.1 s of
    the router's 1.4 s import on an idle machine, and most of its exit)."""
    code = ("import sys, lmcache.router.server, lmcache.pd.proxy; "
            "print(sorted(m for m in ('torch', 'lmcache.memory_management') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]"


class LateKeepAlive:
    """An HTTP/1.1 backend that keeps connections alive for `idle` seconds the way a busy uvicorn
    does: its keep-alive timer runs late, so a request that arrives on a connection idle for longer
    finds it closed instead of answered (a fault the real server shows only under load)."""

    def __init__(self, idle: float) -> None:
        self.idle, self.connections = idle, 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        loop, last = asyncio.get_running_loop(), None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if last is not None and loop.time() - last > self.idle:
                    break  # the timer fired as the request arrived: closed, unanswered
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                answer = json.dumps({"choices": [{"text": "ok"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
                last = loop.time()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@async_test
async def test_an_idle_connection_is_not_reused_past_the_keep_alive_and_a_request_after_a_pause_is_answered(
        monkeypatch):
    """The router (and the PD front, on the same HTTP code) keeps an idle connection to a backend
    for `KEEPALIVE_S`, shorter than the backend's keep-alive (vLLM's is 5 s): a request after a
    longer pause goes out on a new connection, not on one the backend is closing."""
    monkeypatch.setattr(http, "KEEPALIVE_S", 1.0)  # the backend's keep-alive below is 2 s
    backend = LateKeepAlive(idle=2.0)
    port = free_port()
    server = await asyncio.start_server(backend.serve, "127.0.0.1", port)
    try:
        async with Running(RouterConfig((f"127.0.0.1:{port}",))) as r:
            assert [(await r.ask("x"))[0] for _ in range(3)] == [200] * 3
            assert backend.connections == 1  # kept alive while in use
            await asyncio.sleep(2.5)
            status, answer = await r.ask("x")
            assert status == 200, answer
            assert backend.connections == 2
            assert (await r.get("/stats"))["instance_failures"] == 0
    finally:
        server.close()
        await server.wait_closed()


@async_test
async def test_a_bad_body_is_a_400_and_the_config_is_checked():
    async with FakeVLLM("a") as a, Running(RouterConfig((a.url,))) as r:
        async with r.http.post(f"http://127.0.0.1:{r.port}/v1/completions", data=b"[1]") as resp:
            assert resp.status == 400 and "JSON object" in (await resp.json())["error"]["message"]
        deep = b"[" * 100_000 + b"]" * 100_000  # beyond the JSON reader's recursion
        async with r.http.post(f"http://127.0.0.1:{r.port}/v1/completions", data=deep) as resp:
            assert resp.status == 400 and "nested too deeply" in (await resp.json())["error"]["message"]
        assert "lmcache_router_requests_total 2" in await (await r.http.get(
            f"http://127.0.0.1:{r.port}/metrics")).text()
        assert a.bodies == []
    for bad, named in (({"instances": ()}, "instances"), ({"policy": "random"}, "policy"),
                       ({"policy": "kv-aware"}, "needs kv_events"),
                       ({"kv_events": ("tcp://h:1", "tcp://h:2")}, "2 endpoint"),
                       ({"kv_events": ("h:1",)}, "'h:1'"), ({"shared_kv_events": ("http://h:1",)}, "'http://h:1'"),
                       ({"kv_events": ("tcp://nohost",)}, "expected tcp://HOST:PORT"),
                       ({"kv_events": ("tcp://*:5557",)}, "the publisher binds"),
                       ({"max_blocks": 0}, "max_blocks=0"), ({"request_cost": -1}, "request_cost=-1"),
                       ({"tier_weights": {"GPU": math.nan}}, "GPU=nan"),
                       ({"tier_weights": {"CPU": math.inf}}, "CPU=inf"),
                       ({"tier_weights": {"CPU": -0.5}}, "CPU=-0.5")):
        with pytest.raises(ValueError, match=re.escape(named)):
            RouterConfig(**{"instances": ("http://h:1",), **bad})


@async_test
async def test_a_wrong_method_is_a_405_naming_the_allowed_one():
    async with FakeVLLM("a") as a, Running(RouterConfig((a.url,))) as r:
        async with r.http.get(f"http://127.0.0.1:{r.port}/v1/completions") as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
            assert (await resp.json())["error"]["code"] == 405


@async_test
async def test_a_chat_body_the_template_cannot_render_is_forwarded_as_a_miss():
    """The engine judges a body the router cannot tokenize (vLLM answers it 400): messages without a
    role, with a role that is not a string, or none at all go to an instance, not a 500."""
    model = local_model_path("float32")
    async with FakeVLLM("a") as a, FakeVLLM("b") as b:
        config = RouterConfig((a.url, b.url), "kv-aware", ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), model)
        async with Running(config) as r:
            for messages in ([{"content": "hi"}], [{"role": 5, "content": "hi"}], []):
                async with r.http.post(f"http://127.0.0.1:{r.port}/v1/chat/completions",
                                       json={"messages": messages}) as resp:
                    assert resp.status == 200, await resp.text()
            assert len(a.bodies) + len(b.bodies) == 3


@async_test
async def test_served_hits_are_compared_when_the_usage_event_arrives_in_two_reads():
    model = local_model_path("float32")
    tokens = PromptTokenizer(model)("/v1/completions", {"prompt": "The old sailor " * 20})
    async with FakeVLLM("a", cached=32) as a:
        a.split_usage = True
        async with Running(RouterConfig((a.url,), "round-robin", ("tcp://127.0.0.1:1",), model)) as r:
            r.router.index.apply(a.url, [BlockStored([1, 2], None, tokens[:32], 16, None, "GPU", None)])
            status, text = await r.ask("The old sailor " * 20 + "went home", stream=True,
                                       stream_options={"include_usage": True})
            assert status == 200 and '"cached_tokens": 32' in text
            stats = await r.get("/stats")
            assert (stats["hits_compared"], stats["predicted_hit_tokens"], stats["served_hit_tokens"]) == \
                (1, 32, 32)


@async_test
async def test_blocks_stored_under_a_cache_salt_are_predicted_only_for_that_salt():
    """vLLM hashes a request's cache_salt into its first block (its events carry it in
    ``extra_keys``): another tenant's request finds none of those blocks, the same tenant's does."""
    model = local_model_path("float32")
    prompt = "The old sailor " * 20
    tokens = PromptTokenizer(model)("/v1/completions", {"prompt": prompt})
    async with FakeVLLM("a") as a, FakeVLLM("b") as b:
        config = RouterConfig((a.url, b.url), "kv-aware", ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), model)
        async with Running(config) as r:
            r.router.index.apply(b.url, [BlockStored([11, 12], None, tokens[:32], 16, None, "GPU", None,
                                                     extra_keys=[("tenant-A",), None])])
            assert (await r.ask(prompt + "went home", cache_salt="tenant-B"))[0] == 200
            assert (await r.get("/stats"))["predicted_hit_tokens"] == 0
            for _ in range(2):
                status, answer = await r.ask(prompt + "went home", cache_salt="tenant-A")
                assert status == 200 and answer["choices"][0]["text"] == "b"
            assert (await r.get("/stats"))["predicted_hit_tokens"] == 2 * 32


@async_test
async def test_a_prompt_wholly_on_the_shared_server_is_predicted_served_but_its_last_token():
    """LMCache's connector loads what the shared server holds beyond the instance's own prefix, up to
    the prompt's last token but one: 511 of 512, not 256 (the chunks cut to whole ones)."""
    from lmcache.chunk_hash import chunk_digests

    tokens = list(range(1000, 1512))  # two 256-token chunks
    async with FakeVLLM("a", cached=511) as a:
        config = RouterConfig((a.url,), "kv-aware", ("tcp://127.0.0.1:1",), local_model_path("float32"),
                              shared_kv_events=("tcp://127.0.0.1:3",))
        async with Running(config) as r:
            own = BlockStored(list(range(31)), None, tokens[:496], 16, None, "GPU", None)  # 496 tokens
            r.router.index.apply(a.url, [own])
            r.router.watch.shared.apply([BlockStored([d], None, [], 256, None, "CPU", None)
                                         for d in chunk_digests(tokens, 256, whole_only=True)])
            assert (await r.ask(tokens))[0] == 200
            stats = await r.get("/stats")
            assert stats["predicted_hit_tokens"] == stats["served_hit_tokens"] == 511


@async_test
async def test_the_pd_front_picks_the_prefiller_holding_the_prefix_with_kv_aware():
    model = local_model_path("float32")
    prompt = "The old sailor " * 20
    tokens = PromptTokenizer(model)("/v1/completions", {"prompt": prompt})
    async with FakeVLLM("p0") as p0, FakeVLLM("p1") as p1, FakeVLLM("d") as d:
        config = ProxyConfig((p0.url, p1.url), (d.url,), ("127.0.0.1:1",), port=0, prefill_policy="kv-aware",
                             prefiller_kv_events=("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), model=model)
        runner = await start_pd(config)
        try:
            app_proxy = runner.app[PROXY]
            held = BlockStored([1, 2], None, tokens[:32], 16, None, None, None)
            app_proxy.watch.index.apply(p1.url, [held])
            port = runner.addresses[0][1]
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    async with http.post(f"http://127.0.0.1:{port}/v1/completions",
                                         json={"prompt": prompt + "went home"}) as r:
                        assert r.status == 200 and (await r.json())["choices"][0]["text"] == "d"
            assert (len(p0.bodies), len(p1.bodies)) == (0, 3)
        finally:
            await runner.cleanup()
    with pytest.raises(ValueError, match="prefiller_kv_events and model"):
        ProxyConfig(("h:1",), ("h:2",), ("h:3",), prefill_policy="kv-aware")


@async_test
async def test_the_pd_front_counts_what_a_shared_cache_server_publishes_for_every_prefiller(tmp_path):
    """``shared_kv_events`` on the PD front: the chunks a cache server publishes (its own translation,
    over ZMQ) are a cached prefix of every prefiller; a bad endpoint is refused."""
    from lmcache.cache_server.kv_events import chunk_block
    from lmcache.kv_events import KVEventPublisher, to_kv_events
    from lmcache.storage_backend.events import EventKind, PublishedEvent, TierEvent
    from tests.unit.router.test_shared import CHUNK, keys_of

    model = local_model_path("float32")
    tokens = PromptTokenizer(model)("/v1/completions", {"prompt": "The old sailor " * 20})
    publisher = KVEventPublisher(f"ipc://{tmp_path}/events.sock")
    stored = [PublishedEvent("CPU", TierEvent(EventKind.STORED, "Hot", tuple(keys_of(tokens[: 2 * CHUNK]))))]
    events = to_kv_events(stored, lambda key: chunk_block(key, CHUNK, None)).events
    config = ProxyConfig(("http://127.0.0.1:1", "http://127.0.0.1:2"), ("http://127.0.0.1:3",),
                         ("127.0.0.1:4",), port=0, prefill_policy="kv-aware", model=model,
                         prefiller_kv_events=("tcp://127.0.0.1:5", "tcp://127.0.0.1:6"),
                         shared_kv_events=(publisher.endpoint,))
    runner = await start_pd(config)
    try:
        watch = runner.app[PROXY].watch
        for _ in range(100):  # a subscription takes a moment to reach the publisher: publish until seen
            publisher.publish(events)
            await asyncio.sleep(0.05)
            if watch.match(config.prefillers[0], tokens).tokens:
                break
        assert [watch.match(url, tokens).by_tier for url in config.prefillers] == \
            [{"shared": 2 * CHUNK}] * 2
    finally:
        await runner.cleanup()
        publisher.close()
    with pytest.raises(ValueError, match="KV events endpoint 'http://h:7'"):
        ProxyConfig(("h:1",), ("h:2",), ("h:3",), shared_kv_events=("http://h:7",))
