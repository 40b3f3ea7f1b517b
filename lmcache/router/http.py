"""The HTTP pieces every OpenAI-compatible front of LMCache shares (`lmcache router` and its
prefill/decode policy, `lmcache.pd.proxy`): backends and their URLs, OpenAI-shaped errors, the
headers passed on, relaying an answer (whole, or a stream chunk by chunk), the client session, and
`StallWatch`, which finds a backend that keeps its connections open and answers nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from lmcache.backoff import Backoff
from lmcache.observability import IncidentLog

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BODY_BYTES = 64 << 20  # long prompts and inline images are large
ANSWER_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10)  # an answer may take long
# How long an idle connection to a backend is kept for the next request: shorter than vLLM's own
# keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s, as uvicorn's default), so that no request goes out
# on a connection the server has closed or is closing. With aiohttp's 15 s, a decoder's connection
# left idle for 10 s while the prefiller ran failed as the next request was written on it ("Can
# not write request body"), and the request got a 503 from a healthy decoder.
KEEPALIVE_S = 2.0


def base_url(field: str, value: str) -> str:
    """`value` as an ``http(s)://HOST:PORT`` base URL (``http://`` added when missing)."""
    url = value if "://" in value else f"http://{value}"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not one
    except ValueError as e:
        raise ValueError(f"{field}: {value!r} is not a URL: {e}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"{field}: {value!r} is not an http(s)://HOST:PORT URL")
    return url.rstrip("/")


class Backend:
    """One vLLM instance: its failures are an incident (logged on `log`) and make it backed off from."""

    def __init__(self, role: str, url: str, backoff: float, consequence: str, log: logging.Logger,
                 kv: str = "") -> None:
        self.url = url
        self.kv = kv  # a decoder's KV receiver address
        self.sent = 0
        self.backoff = Backoff(backoff, max(backoff, 30.0))
        self.incidents = IncidentLog(log, f"{role} {url}", consequence=consequence)

    def failed(self, error: BaseException | str) -> None:
        self.incidents.fail(error)
        self.backoff.failed()

    def answered(self) -> None:
        self.incidents.recover()
        self.backoff.succeeded()


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message), status=status, headers=headers)


def sse_error(status: int, message: str) -> bytes:
    """The event that ends a stream the backend broke off."""
    return f"data: {json.dumps(error_body(status, message))}\n\n".encode()


def relayed(status: int, body: bytes, content_type: str | None,
            extra: dict[str, str] | None = None) -> web.Response:
    headers = {"Content-Type": content_type or "application/json", **(extra or {})}
    return web.Response(body=body, status=status, headers=headers)


def passed_on(request: web.Request) -> dict[str, str]:
    """The client's headers the backends get (its ``Authorization``)."""
    auth = request.headers.get("Authorization")
    return {} if auth is None else {"Authorization": auth}


def session_of(request: web.Request, body: dict[str, Any]) -> str | None:
    """The request's session: the ``X-Session-ID`` header, else the body's ``user``."""
    session = request.headers.get("X-Session-ID") or body.get("user")
    return session if isinstance(session, str) else None


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; ValueError (the client's 400) otherwise."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("the body is JSON nested too deeply to read") from None
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object, not a {type(body).__name__}")
    return body


async def relay_stream(request: web.Request, answer: aiohttp.ClientResponse, chunks: AsyncIterator[bytes],
                       extra: dict[str, str] | None = None) -> web.StreamResponse:
    """Writes `chunks` (of `answer`) to the client as they come, with the `extra` headers; a client
    that left ends it."""
    content_type = answer.headers.get("Content-Type", "text/event-stream")
    headers = {"Content-Type": content_type, "Cache-Control": "no-cache", **(extra or {})}
    out = web.StreamResponse(headers=headers)
    try:
        await out.prepare(request)
        async for chunk in chunks:
            await out.write(chunk)
    except ConnectionResetError:
        pass  # the client left (leaving the caller's `async with` drops the backend's answer)
    return out


class ClientSession:
    """One aiohttp client session (unbounded connection pool, idle connections kept KEEPALIVE_S)
    for an app's life."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector, timeout=ANSWER_TIMEOUT)
        yield
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the app is not running"
        return self._session


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405 with its ``Allow``, 413) and bugs answered in OpenAI's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kept = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
        return error_response(e.status, e.reason, kept)
    except Exception as e:
        logger.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"proxy error: {e}")


def new_app(session: ClientSession) -> web.Application:
    """An app with the shared middleware and client session; the caller adds its routes."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[openai_errors])
    app.cleanup_ctx.append(session.context)
    return app


async def health_of(session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
    """Whether `url`'s ``/health`` answers 200 within `timeout` seconds."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


class Unresponsive(aiohttp.ClientError):
    """A backend that keeps its connection open but answers nothing, not even its /health."""


class StallWatch:
    """Waits on backends' answers. Each `stall_timeout` seconds one has not come (an answer's
    start, or the next chunk of its body), the backend's /health is probed, and if that does not
    answer 200 within `health_timeout`, the wait ends in `Unresponsive` (a stopped or hung process;
    a busy one still answers its /health). One probe per backend at a time, its answer kept for
    `stall_timeout` for the other requests waiting on that backend."""

    def __init__(self, client: ClientSession, stall_timeout: float, health_timeout: float) -> None:
        self.client = client
        self.stall_timeout, self.health_timeout = stall_timeout, health_timeout
        self._checks: dict[str, tuple[float, asyncio.Future[bool]]] = {}  # url -> (started, /health answered)

    async def started(self, url: str, request: Awaitable[T]) -> T:
        """`request`'s answer (its status and headers) from the backend at `url`, awaited here (a
        watchdog beside it cuts the wait short)."""
        deadline = asyncio.timeout(None)
        stalled: list[str] = []
        try:
            async with deadline:
                watchdog = asyncio.ensure_future(self._watch(url, deadline, stalled))
                try:
                    return await request
                finally:
                    watchdog.cancel()
        except TimeoutError:
            if not stalled:
                raise  # the request's own timeout
            raise Unresponsive(stalled[0]) from None

    async def _watch(self, url: str, deadline: asyncio.Timeout, stalled: list[str]) -> None:
        waited = 0.0
        while True:
            await asyncio.sleep(self.stall_timeout)
            waited += self.stall_timeout
            if not await self._answering(url):
                stalled.append(self._stalled(waited))
                deadline.reschedule(asyncio.get_running_loop().time())
                return

    async def chunk(self, url: str, content: aiohttp.StreamReader) -> bytes:
        """The next chunk of an answer's body (b"" at its end), read where it arrives (a wait cut
        short leaves what came in `content`)."""
        waited = 0.0
        while True:
            stall = asyncio.timeout(self.stall_timeout)
            try:
                async with stall:
                    return await content.readany()
            except TimeoutError:
                if not stall.expired():
                    raise  # the request's own timeout
            waited += self.stall_timeout
            if not await self._answering(url):
                raise Unresponsive(self._stalled(waited))

    async def body(self, url: str, content: aiohttp.StreamReader) -> bytes:
        """An answer's whole body."""
        parts = []
        while part := await self.chunk(url, content):
            parts.append(part)
        return b"".join(parts)

    async def _answering(self, url: str) -> bool:
        check = self._checks.get(url)
        now = time.monotonic()
        if check is None or (check[1].done() and now - check[0] >= self.stall_timeout):
            probe = health_of(self.client.session, url, self.health_timeout)
            check = self._checks[url] = (now, asyncio.ensure_future(probe))
        return await asyncio.shield(check[1])

    def _stalled(self, waited: float) -> str:
        return (f"nothing came for {waited:g} s and /health did not answer 200 within "
                f"{self.health_timeout:g} s")


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serves `app` in the running event loop until `await runner.cleanup()`; `runner.addresses`
    has the bound port (for ``port=0``)."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
