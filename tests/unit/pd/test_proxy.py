"""`lmcache proxy` against fake vLLM instances (small aiohttp servers on loopback ports): the
prefiller is asked for one token with the decoder's KV address (or, for vLLM's NixlConnector, to
keep the KV for the decoder, whose body then carries where it is), the decoder gets the client's
body and its answer (streamed chunk by chunk) reaches the client; a failing prefiller is skipped, a
failing decoder is a 503, bad bodies are a 400, and the proxy keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from lmcache import cli
from lmcache.integration.local_model import local_model_path
from lmcache.pd import proxy
from lmcache.pd.proxy import HANDOFFS, LMCachePush, ProxyConfig, prefill_body
from tests.helpers.aio import async_test
from tests.helpers.servers import free_port

pytestmark = pytest.mark.timeout(30)
PATH = "/v1/completions"


class FakeVLLM:
    """A vLLM stand-in on a free loopback port (not listening until `start`). It records each
    generation request, answers it OpenAI-shaped (an SSE stream of `words` when asked to stream)
    or, when `status` is not 200, with that error. `delay` holds every answer back; the stream
    waits for `gate` (if set) before its last word; `die_after` words it drops the connection;
    `abandoned` is set when a stream's client goes away; `hung`: its /health answers nothing."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.kv = f"kv-{name}:{self.port}"  # the KV receiver address the proxy passes on
        self.received: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.status = 200
        self.healthy = True
        self.hung = False
        self.delay = 0.0
        self.words = ["Hello", " from", f" {name}"]
        self.gate: asyncio.Event | None = None
        self.die_after: int | None = None
        self.abandoned = asyncio.Event()  # a stream's client went away
        self.kv_transfer_params: Any = None  # put in non-streamed answers when set
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def answer(self, path: str) -> dict[str, Any]:
        text = "".join(self.words)
        if path.endswith("/chat/completions"):
            return {"id": f"chat-{self.name}", "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
        return {"id": f"cmpl-{self.name}", "object": "text_completion",
                "choices": [{"index": 0, "text": text}]}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.auth.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.delay)
        if self.status != 200:
            error = {"message": f"{self.name} says {self.status}", "type": "BadRequestError"}
            return web.json_response({"error": {**error, "code": self.status}}, status=self.status)
        if body.get("stream"):
            return await self.stream(request)
        if self.die_after is not None:
            out = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "1000"})
            await out.prepare(request)
            await out.write(b'{"id": "cut')
            return self.drop(request, out)
        answer = self.answer(request.path)
        if self.kv_transfer_params is not None:
            answer["kv_transfer_params"] = self.kv_transfer_params
        return web.json_response(answer)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            for i, word in enumerate(self.words):
                if i == self.die_after:
                    return self.drop(request, out)
                if i == len(self.words) - 1 and self.gate is not None:
                    await asyncio.wait_for(self.gate.wait(), 10)
                await out.write(sse({"id": f"cmpl-{self.name}", "choices": [{"index": 0, "text": word}]}))
        except asyncio.CancelledError:
            self.abandoned.set()
            raise
        await out.write(b"data: [DONE]\n\n")
        return out

    @staticmethod
    def drop(request: web.Request, out: web.StreamResponse) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()
        return out

    async def models(self, request: web.Request) -> web.Response:
        self.auth.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": [{"id": f"model-{self.name}"}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.hung:
            await asyncio.sleep(30)  # cancelled when it stops
        return web.Response(status=200 if self.healthy else 503)


def sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


class Client:
    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.base + path, data=data, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        async with self.session.get(self.base + path, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def stats(self) -> dict[str, Any]:
        return (await self.get("/stats"))[1]


@asynccontextmanager
async def deployment(prefillers: list[FakeVLLM], decoders: list[FakeVLLM], dead: tuple[FakeVLLM, ...] = (),
                     **options: Any) -> AsyncIterator[Client]:
    """The proxy in front of `prefillers` and `decoders` (all started but the `dead` ones)."""
    fakes = [f for f in prefillers + decoders if f not in dead]
    for fake in fakes:
        await fake.start()
    handoff = HANDOFFS[options.get("kv_protocol", LMCachePush.name)]
    kv = tuple(d.kv for d in decoders) if handoff.needs_decoder_kv else ()
    config = ProxyConfig(tuple(p.url for p in prefillers), tuple(d.url for d in decoders), kv, port=0,
                         **options)
    runner = await proxy.start(config)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
            yield Client(session, f"http://127.0.0.1:{runner.addresses[0][1]}")
    finally:
        await runner.cleanup()
        for fake in prefillers + decoders:
            await fake.stop()


def receiver(body: dict[str, Any]) -> str:
    return body["kv_transfer_params"]["lmcache"]["pd_receiver"]


def test_prefill_body_asks_one_token_for_the_receiver_and_keeps_the_rest() -> None:
    body = {"prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 10, "n": 3,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5,
            "kv_transfer_params": {"other": {"x": 1}, "lmcache": {"mine": True}}}
    original = json.loads(json.dumps(body))
    assert prefill_body(body, LMCachePush.prefill_params(body["kv_transfer_params"], "10.0.0.2:7000")) == {
        "prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1, "n": 1, "stream": False,
        "temperature": 0.5,
        "kv_transfer_params": {"other": {"x": 1}, "lmcache": {"mine": True, "pd_receiver": "10.0.0.2:7000"}}}
    assert body == original
    assert prefill_body({"prompt": "hi"}, LMCachePush.prefill_params(None, "h:1")) == {
        "prompt": "hi", "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"lmcache": {"pd_receiver": "h:1"}}}


@async_test
async def test_completion_is_prefilled_then_answered_by_the_decoder() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    async with deployment([prefiller], [decoder]) as client:
        body = {"model": "m", "prompt": "The cache", "max_tokens": 20, "temperature": 0}
        status, answer = await client.post("/v1/completions", body)
    assert (status, answer) == (200, decoder.answer(PATH))
    assert prefiller.received == [{**body, "max_tokens": 1, "stream": False,
                                   "kv_transfer_params": {"lmcache": {"pd_receiver": decoder.kv}}}]
    assert decoder.received == [body]


@async_test
async def test_chat_is_prefilled_with_the_clients_params_and_authorization_passed_on() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 30,
            "n": 2, "kv_transfer_params": {"other": {"x": 1}}}
    async with deployment([prefiller], [decoder]) as client:
        status, answer = await client.post("/v1/chat/completions", body, {"Authorization": "Bearer k"})
    assert (status, answer) == (200, decoder.answer("/v1/chat/completions"))
    [sent] = prefiller.received
    assert (sent["max_tokens"], sent["max_completion_tokens"], sent["n"], sent["stream"]) == (1, 1, 1, False)
    assert sent["kv_transfer_params"] == {"other": {"x": 1}, "lmcache": {"pd_receiver": decoder.kv}}
    assert decoder.received == [body]
    assert prefiller.auth == decoder.auth == ["Bearer k"]


@async_test
async def test_stream_reaches_the_client_while_the_decoder_is_still_writing() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    decoder.gate = asyncio.Event()  # the decoder's last word waits until the client has the first
    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with deployment([prefiller], [decoder]) as client:
        async with client.session.post(client.base + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "Hello"
            decoder.gate.set()
            rest = await r.content.read()
    assert rest == sse({"id": "cmpl-d0", "choices": [{"index": 0, "text": " from"}]}) + \
        sse({"id": "cmpl-d0", "choices": [{"index": 0, "text": " d0"}]}) + b"data: [DONE]\n\n"
    [sent] = prefiller.received
    assert sent["stream"] is False and "stream_options" not in sent and sent["max_tokens"] == 1
    assert decoder.received == [body]


@async_test
async def test_client_leaving_a_stream_drops_the_decoders_request() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    decoder.gate = asyncio.Event()  # never set: the decoder would wait 10 s for its last word
    async with deployment([prefiller], [decoder]) as client:
        body = {"prompt": "hi", "stream": True}
        async with client.session.post(client.base + "/v1/completions", json=body) as r:
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            r.close()
        await asyncio.wait_for(decoder.abandoned.wait(), 5)


@async_test
async def test_2p2d_prefillers_and_decoders_take_turns_and_each_prefill_names_its_decoder() -> None:
    prefillers, decoders = [FakeVLLM("p0"), FakeVLLM("p1")], [FakeVLLM("d0"), FakeVLLM("d1")]
    async with deployment(prefillers, decoders) as client:
        for i in range(4):
            status, answer = await client.post("/v1/completions", {"prompt": f"request {i}", "max_tokens": 5})
            assert (status, answer["id"]) == (200, f"cmpl-d{i % 2}")
        stats = await client.stats()
    for k in range(2):
        assert [b["prompt"] for b in prefillers[k].received] == [f"request {k}", f"request {k + 2}"]
        assert [b["prompt"] for b in decoders[k].received] == [f"request {k}", f"request {k + 2}"]
        assert [receiver(b) for b in prefillers[k].received] == [decoders[k].kv] * 2
    assert stats["prefillers"] == {p.url: 2 for p in prefillers}
    assert stats["decoders"] == {d.url: 2 for d in decoders}


@async_test
async def test_dead_prefiller_leaves_the_decoder_to_answer_and_is_then_skipped(caplog) -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    body = {"prompt": "hi", "max_tokens": 5}
    async with deployment([prefiller], [decoder], dead=(prefiller,), backoff=30) as client:
        with caplog.at_level(logging.DEBUG, logger=proxy.__name__):
            assert await client.post("/v1/completions", body) == (200, decoder.answer(PATH))
            stats = await client.stats()
            assert (stats["prefill_failures"], stats["prefill_skipped"], stats["prefilled"]) == (1, 0, 0)
            assert await client.post("/v1/completions", body) == (200, decoder.answer(PATH))
            stats = await client.stats()
    assert (stats["prefill_failures"], stats["prefill_skipped"], stats["prefilled"]) == (1, 1, 0)
    assert stats["prefillers"] == {prefiller.url: 1}
    assert decoder.received == [body, body]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and prefiller.url in warnings[0].getMessage()


@async_test
async def test_prefiller_timing_out_is_given_up_on_and_not_waited_for_again() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    prefiller.delay = 10.0
    body = {"prompt": "hi", "max_tokens": 5}
    async with deployment([prefiller], [decoder], prefill_timeout=0.3, backoff=30) as client:
        started = time.monotonic()
        assert await client.post("/v1/completions", body) == (200, decoder.answer(PATH))
        first = time.monotonic() - started
        started = time.monotonic()
        assert await client.post("/v1/completions", body) == (200, decoder.answer(PATH))
        second = time.monotonic() - started
        stats = await client.stats()
    assert 0.3 <= first < 3 and second < 0.25
    assert (stats["prefill_failures"], stats["prefill_skipped"]) == (1, 1)
    assert len(prefiller.received) == 1 and decoder.received == [body, body]


@async_test
async def test_prefiller_answering_500_leaves_the_decoder_to_answer_until_it_works_again(caplog) -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    prefiller.status = 500
    body = {"prompt": "hi", "max_tokens": 5}
    async with deployment([prefiller], [decoder], backoff=0.05) as client:
        with caplog.at_level(logging.INFO, logger=proxy.__name__):
            assert await client.post("/v1/completions", body) == (200, decoder.answer(PATH))
            assert (await client.stats())["prefill_failures"] == 1
            prefiller.status = 200
            await asyncio.sleep(0.1)  # the backoff has passed
            assert await client.post("/v1/completions", body) == (200, decoder.answer(PATH))
            stats = await client.stats()
    assert (stats["prefill_failures"], stats["prefilled"], stats["prefill_skipped"]) == (1, 1, 0)
    assert len(prefiller.received) == 2 and decoder.received == [body, body]
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for level, m in messages if level == logging.WARNING and prefiller.url in m]
    assert [m for level, m in messages if level == logging.INFO and m.endswith("works again")]


@async_test
async def test_prefiller_rejecting_the_request_is_the_answer_and_the_decoder_is_not_asked() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    prefiller.status = 400
    async with deployment([prefiller], [decoder]) as client:
        status, answer = await client.post("/v1/completions", {"prompt": "too long", "max_tokens": 5})
        stats = await client.stats()
    assert status == 400 and answer["error"]["message"] == "p0 says 400"
    assert decoder.received == []
    assert (stats["prefill_rejected"], stats["prefill_failures"]) == (1, 0)
    assert stats["decoders"] == {decoder.url: 0}


@async_test
async def test_dead_decoder_is_a_503_naming_it_and_the_proxy_serves_it_once_back() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    body = {"prompt": "hi", "max_tokens": 5}
    async with deployment([prefiller], [decoder], dead=(decoder,)) as client:
        status, answer = await client.post("/v1/completions", body)
        assert status == 503 and decoder.url in answer["error"]["message"]
        assert (answer["error"]["type"], answer["error"]["code"]) == ("server_error", 503)
        assert (await client.stats())["decoder_failures"] == 1
        await decoder.start()
        assert await client.post("/v1/completions", body) == (200, decoder.answer(PATH))
        assert (await client.stats())["decoder_failures"] == 1
    assert decoder.received == [body]


@async_test
async def test_a_failed_decoder_is_passed_over_while_the_other_answers() -> None:
    prefiller, dead, live = FakeVLLM("p0"), FakeVLLM("d0"), FakeVLLM("d1")
    async with deployment([prefiller], [dead, live], dead=(dead,), backoff=30) as client:
        statuses = [(await client.post("/v1/completions", {"prompt": str(i)}))[0] for i in range(3)]
        stats = await client.stats()
    assert statuses == [503, 200, 200]
    assert [receiver(b) for b in prefiller.received] == [dead.kv, live.kv, live.kv]
    assert (stats["decoder_failures"], stats["decoders"]) == (1, {dead.url: 1, live.url: 2})


@async_test
async def test_decoder_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    decoder.die_after = 1
    async with deployment([prefiller], [decoder]) as client:
        async with client.session.post(client.base + "/v1/completions",
                                       json={"prompt": "hi", "stream": True}) as r:
            received = await r.content.read()
        events = [json.loads(e.removeprefix(b"data: ")) for e in received.split(b"\n\n") if e]
        assert events[0] == {"id": "cmpl-d0", "choices": [{"index": 0, "text": "Hello"}]}
        assert len(events) == 2 and decoder.url in events[1]["error"]["message"]
        assert (await client.stats())["decoder_failures"] == 1
        decoder.die_after = None
        assert await client.post("/v1/completions", {"prompt": "hi"}) == (200, decoder.answer(PATH))


@async_test
async def test_decoder_dying_mid_answer_is_a_503() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    decoder.die_after = 0
    async with deployment([prefiller], [decoder]) as client:
        status, answer = await client.post("/v1/completions", {"prompt": "hi"})
        assert status == 503 and decoder.url in answer["error"]["message"]
        assert (await client.stats())["decoder_failures"] == 1


@async_test
async def test_a_stopped_prefiller_or_decoder_is_found_by_its_health_not_waited_for() -> None:
    """A stopped process's port: the kernel accepts connections into its backlog, and nothing
    reads or answers them, its /health included."""
    body = {"prompt": "hi", "max_tokens": 5}
    for stopped_role in ("prefiller", "decoder"):
        prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
        stopped = prefiller if stopped_role == "prefiller" else decoder
        with socket.socket() as port:
            port.bind(("127.0.0.1", stopped.port))
            port.listen(16)
            async with deployment([prefiller], [decoder], dead=(stopped,), stall_timeout=0.3,
                                  health_timeout=0.3) as client:
                started = time.monotonic()
                status, answer = await client.post("/v1/completions", body)
                took = time.monotonic() - started
                stats = await client.stats()
        assert took < 5, stopped_role
        if stopped_role == "prefiller":
            assert (status, answer) == (200, decoder.answer(PATH))
            assert stats["prefill_failures"] == 1 and decoder.received == [body]
        else:
            assert status == 503 and "/health did not answer" in answer["error"]["message"]
            assert stats["decoder_failures"] == 1 and len(prefiller.received) == 1


@async_test
async def test_a_decoder_that_stops_mid_stream_ends_the_stream_with_an_error_event() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    decoder.gate = asyncio.Event()  # never set: its last word never comes
    async with deployment([prefiller], [decoder], stall_timeout=0.3, health_timeout=0.3) as client:
        decoder.hung = True
        async with client.session.post(client.base + "/v1/completions",
                                       json={"prompt": "hi", "stream": True}) as r:
            received = await r.content.read()
        events = [json.loads(e.removeprefix(b"data: ")) for e in received.split(b"\n\n") if e]
        assert [e["choices"][0]["text"] for e in events[:2]] == ["Hello", " from"]
        assert len(events) == 3 and "/health did not answer" in events[2]["error"]["message"]
        assert (await client.stats())["decoder_failures"] == 1


@async_test
async def test_body_that_is_not_a_json_object_is_a_400_and_nothing_is_forwarded() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    async with deployment([prefiller], [decoder]) as client:
        bad_json = await client.post("/v1/completions", b"{not json")
        a_list = await client.post("/v1/chat/completions", [{"prompt": "hi"}])
        too_deep = await client.post("/v1/completions", b"[" * 100_000 + b"]" * 100_000)
        stats = await client.stats()
    for status, answer in (bad_json, a_list, too_deep):
        assert status == 400 and set(answer["error"]) == {"message", "type", "code"}
        assert (answer["error"]["type"], answer["error"]["code"]) == ("invalid_request_error", 400)
    assert "not valid JSON" in bad_json[1]["error"]["message"]
    assert "not a list" in a_list[1]["error"]["message"]
    assert "nested too deeply" in too_deep[1]["error"]["message"]
    assert prefiller.received == decoder.received == []
    assert (stats["requests"], stats["bad_requests"]) == (3, 3)


@async_test
async def test_a_chat_the_template_cannot_render_goes_to_the_backends_with_a_kv_aware_prefiller() -> None:
    """The prefill policy's tokenizer cannot render messages without a role: the request is routed
    as a miss and the backends judge it (here they answer), not a 500."""
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    kv_aware = {"prefill_policy": "kv-aware", "prefiller_kv_events": ("tcp://127.0.0.1:1",),
                "model": local_model_path("float32")}
    async with deployment([prefiller], [decoder], **kv_aware) as client:
        status, answer = await client.post("/v1/chat/completions", {"messages": [{"content": "hi"}]})
    assert status == 200, answer
    assert len(prefiller.received) == len(decoder.received) == 1


@async_test
async def test_unknown_path_is_an_openai_shaped_404() -> None:
    async with deployment([FakeVLLM("p0")], [FakeVLLM("d0")]) as client:
        status, answer = await client.get("/v1/nothing")
    assert status == 404 and answer["error"]["code"] == 404


@async_test
async def test_health_is_200_while_a_decoder_is_healthy_and_503_when_none_is() -> None:
    live, dead, decoder = FakeVLLM("p0"), FakeVLLM("p1"), FakeVLLM("d0")
    async with deployment([live, dead], [decoder], dead=(dead,)) as client:
        healthy = await client.get("/health")
        decoder.healthy = False
        unhealthy = await client.get("/health")
    prefillers = [{"url": live.url, "healthy": True}, {"url": dead.url, "healthy": False}]
    assert healthy == (200, {"status": "ok", "prefillers": prefillers,
                             "decoders": [{"url": decoder.url, "healthy": True}]})
    assert unhealthy == (503, {"status": "unavailable", "prefillers": prefillers,
                               "decoders": [{"url": decoder.url, "healthy": False}]})


@async_test
async def test_models_come_from_a_decoder() -> None:
    decoder = FakeVLLM("d0")
    async with deployment([FakeVLLM("p0")], [decoder]) as client:
        answer = await client.get("/v1/models", {"Authorization": "Bearer k"})
    assert answer == (200, {"object": "list", "data": [{"id": "model-d0"}]})
    assert decoder.auth == ["Bearer k"]


@async_test
async def test_stats_count_requests_and_what_each_backend_was_sent() -> None:
    prefiller, decoders = FakeVLLM("p0"), [FakeVLLM("d0"), FakeVLLM("d1")]
    async with deployment([prefiller], decoders) as client:
        for _ in range(3):
            assert (await client.post("/v1/completions", {"prompt": "hi"}))[0] == 200
        stats = await client.stats()
    assert stats == {"requests": 3, "prefilled": 3, "prefill_failures": 0, "prefill_skipped": 0,
                     "prefill_rejected": 0, "decoder_failures": 0, "bad_requests": 0,
                     "prefillers": {prefiller.url: 3}, "decoders": {decoders[0].url: 2, decoders[1].url: 1}}


NIXL_ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


@async_test
async def test_nixl_handoff_passes_the_prefillers_kv_params_to_the_decoder() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    where = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
             "remote_engine_id": "e-p0", "remote_host": "localhost", "remote_port": 5600}
    prefiller.kv_transfer_params = where
    async with deployment([prefiller], [decoder], kv_protocol="nixl") as client:
        body = {"model": "m", "prompt": "The cache", "max_tokens": 20, "stream": True,
                "kv_transfer_params": {"client": 1}}
        async with client.session.post(client.base + PATH, json=body) as r:
            streamed = (r.status, await r.read())
    assert streamed[0] == 200 and b" d0" in streamed[1]
    assert prefiller.received == [{"model": "m", "prompt": "The cache", "max_tokens": 1, "stream": False,
                                   "kv_transfer_params": {"client": 1, **NIXL_ASK}}]
    assert decoder.received == [{**body, "kv_transfer_params": where}]


@async_test
async def test_nixl_handoff_without_params_or_a_prefiller_leaves_the_prefill_to_the_decoder() -> None:
    prefiller, decoder = FakeVLLM("p0"), FakeVLLM("d0")
    async with deployment([prefiller], [decoder], kv_protocol="nixl") as client:
        body = {"model": "m", "prompt": "The cache", "max_tokens": 20}
        assert (await client.post(PATH, body))[0] == 200  # the prefiller answered no kv_transfer_params
        prefiller.status = 500
        assert (await client.post(PATH, body))[0] == 200
        stats = await client.stats()
    assert decoder.received == [body, body]
    assert (stats["prefilled"], stats["prefill_failures"]) == (1, 1)


def test_config_takes_urls_without_scheme_and_names_the_bad_field() -> None:
    config = ProxyConfig.parse("127.0.0.1:8100/, http://h:8101", "https://d:8200", "d:7000")
    assert config.prefillers == ("http://127.0.0.1:8100", "http://h:8101")
    assert (config.decoders, config.decoder_kv) == (("https://d:8200",), ("d:7000",))
    with pytest.raises(ValueError, match="prefillers: 'http://h:99999'"):
        ProxyConfig.parse("http://h:99999", "d:1", "d:7000")
    with pytest.raises(ValueError, match="prefill_timeout=0"):
        ProxyConfig.parse("p:1", "d:1", "d:7000", prefill_timeout=0)


@pytest.mark.parametrize(("prefiller", "decoder", "kv", "named"), [
    ("p:8100", "d:8200,d:8201", "d:7000", "decoder_kv: 1 KV address(es) for 2 decoder(s)"),
    ("ftp://p:8100", "d:8200", "d:7000", "prefillers: 'ftp://p:8100'"),
    ("p:8100", "d:8200", "d-without-port", "decoder_kv: 'd-without-port'"),
    ("p:8100", ",", "", "at least one"),
    ("p:8100", "d:8200", "", "decoder_kv: 0 KV address(es) for 1 decoder(s)"),
])
def test_cli_rejects_bad_arguments_before_serving(monkeypatch, prefiller, decoder, kv, named) -> None:
    monkeypatch.setattr(proxy, "run", lambda config: pytest.fail("the proxy must not start"))
    with pytest.raises(SystemExit, match=re.escape(named)):
        cli.main(["proxy", "--prefiller", prefiller, "--decoder", decoder, "--decoder-kv", kv])


def test_cli_starts_the_proxy_with_its_arguments(monkeypatch) -> None:
    started: list[ProxyConfig] = []
    monkeypatch.setattr(proxy, "run", started.append)
    assert cli.main(["proxy", "--prefiller", "p:8100,p:8101", "--decoder", "d:8200", "--decoder-kv",
                     "10.0.0.2:7000", "--port", "9000", "--prefill-timeout", "30"]) == 0
    assert started == [ProxyConfig(("http://p:8100", "http://p:8101"), ("http://d:8200",), ("10.0.0.2:7000",),
                                   port=9000, prefill_timeout=30)]


def test_cli_nixl_handoff_needs_no_decoder_kv_and_refuses_one(monkeypatch) -> None:
    started: list[ProxyConfig] = []
    monkeypatch.setattr(proxy, "run", started.append)
    assert cli.main(["proxy", "--prefiller", "p:8100", "--decoder", "d:8200", "--kv-protocol", "nixl"]) == 0
    assert started == [ProxyConfig(("http://p:8100",), ("http://d:8200",), kv_protocol="nixl")]
    with pytest.raises(SystemExit, match="decoder_kv: not used by the nixl hand-off"):
        cli.main(["proxy", "--prefiller", "p:8100", "--decoder", "d:8200", "--kv-protocol", "nixl",
                  "--decoder-kv", "d:7000"])
    with pytest.raises(SystemExit, match="kv_protocol='mooncake': expected one of lmcache, nixl"):
        cli.main(["proxy", "--prefiller", "p:8100", "--decoder", "d:8200", "--kv-protocol", "mooncake"])


def test_cli_passes_the_shared_cache_servers_events_to_the_proxy(monkeypatch) -> None:
    started: list[ProxyConfig] = []
    monkeypatch.setattr(proxy, "run", started.append)
    assert cli.main(["proxy", "--prefiller", "p:8100", "--decoder", "d:8200", "--decoder-kv", "d:7000",
                     "--shared-kv-events", "tcp://s:5600, ipc:///tmp/s.sock"]) == 0
    assert started[0].shared_kv_events == ("tcp://s:5600", "ipc:///tmp/s.sock")
    with pytest.raises(SystemExit, match="KV events endpoint 's:5600'"):
        cli.main(["proxy", "--prefiller", "p:8100", "--decoder", "d:8200", "--decoder-kv", "d:7000",
                  "--shared-kv-events", "s:5600"])
