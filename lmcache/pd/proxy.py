"""`lmcache proxy` (= `lmcache router --policy pd`): the OpenAI-compatible front of a prefill/decode
disaggregated deployment, on the router's shared HTTP code (`lmcache.router.http`).

It stands before 1..N prefill and 1..M decode vLLM instances (xPyD). For each
``POST /v1/completions`` or ``POST /v1/chat/completions``:

1. A prefiller and a decoder are picked, each round-robin on its own (passing over backends that
   are backing off after a failure). The prefiller can instead be picked by another policy of
   `lmcache.router.policies` (``prefill_policy``): ``kv-aware`` ranks the ready prefillers by the
   prompt's prefix each holds (from their KV events, ``prefiller_kv_events``, and the model's
   tokenizer, ``model``; plus what a cache server they share holds, ``shared_kv_events``) and their
   load; ``session`` keeps a session on one prefiller.
2. The prefiller is sent the client's body, on the same path, rewritten by `prefill_body`:
   ``max_tokens: 1`` (and ``max_completion_tokens: 1`` if present; ``min_tokens`` dropped),
   ``stream: false`` (``stream_options`` dropped), ``n: 1`` if present, and the
   ``kv_transfer_params`` of the KV hand-off (``--kv-protocol``, see `HANDOFFS`). The proxy waits
   for the whole answer.
3. The decoder is sent the client's body (with what the hand-off adds from the prefiller's answer),
   and its answer is relayed with its status: a stream (``"stream": true`` and a 200) chunk by
   chunk as the decoder writes it, anything else whole.

The two KV hand-offs:

- ``lmcache`` (LMCache's connector with ``enable_pd``; the default): the prefiller is told
  ``{"lmcache": {"pd_receiver": "HOST:PORT"}}`` (merged into the client's own params), HOST:PORT
  being the chosen decoder's KV receiver (its ``pd_peer_host:pd_peer_init_port``, from
  ``--decoder-kv``). The prefiller's connector reads it (`lmcache.pd.params.receiver_of`) and
  pushes the prompt's KV there before it answers; the decoder gets the client's body unchanged.
- ``nixl`` (vLLM's own ``NixlConnector``): the prefiller is told ``do_remote_decode`` (it keeps
  the prompt's blocks for the decoder to read); its answer's ``kv_transfer_params`` (where the
  blocks are) go into the decoder's body, and the decoder pulls the KV before its first step.

Faults (each backend is an incident of its own: one warning, then "works again"):

- A prefiller that cannot be reached, does not answer within ``prefill_timeout`` or answers 5xx:
  counted in ``prefill_failures``; the decoder answers alone (it prefills itself) and the
  prefiller is passed over for a growing backoff. While every prefiller is backing off, requests go
  straight to a decoder (``prefill_skipped``).
- A prefiller answering 4xx rejected the request itself (e.g. a prompt too long): its answer goes
  back to the client and no decoder is asked (``prefill_rejected``).
- A decoder that cannot be reached or dies mid-answer: 503 naming it (a stream already started
  ends with an SSE error event instead), counted in ``decoder_failures``.
- A backend that keeps its connection open and answers nothing (a stopped or hung process) is
  found by its ``/health`` (`lmcache.router.http.StallWatch`: probed each ``stall_timeout``
  seconds a request waits on it) and is then a failure as above: a prefiller's request goes to
  the decoder alone, a decoder's is a 503 (or ends its stream with an SSE error event).
- A body that is not a JSON object (nested too deeply to read included): 400, nothing forwarded
  (``bad_requests``). A chat body the model's chat template cannot render is forwarded as a miss
  (the prefiller judges it).

Every error the proxy itself produces has OpenAI's shape: ``{"error": {"message", "type", "code"}}``.
The client's ``Authorization`` header is passed on to the backends. A client that goes away cancels
its request: the connections to the backends are closed, so vLLM aborts the request.

Endpoints: the two above; ``GET /v1/models`` (forwarded to a decoder); ``GET /health`` (asks each
backend's ``/health``: 200 ``{"status": "ok", "prefillers": [{"url", "healthy"}], "decoders": [...]}``,
503 with ``"status": "unavailable"`` when no decoder is healthy); ``GET /stats`` (the counters, and
the requests sent to each backend by URL).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

import aiohttp
from aiohttp import web

from lmcache.kv_events import check_endpoints
from lmcache.observability import Counters
from lmcache.pd.params import with_receiver
from lmcache.router.http import (
    Backend,
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
from lmcache.router.policies import POLICIES, Instance, Routed
from lmcache.router.tokens import request_keys
from lmcache.router.watch import KVWatch

logger = logging.getLogger(__name__)

COUNTERS = ("requests", "prefilled", "prefill_failures", "prefill_skipped", "prefill_rejected",
            "decoder_failures", "bad_requests")


class KVHandoff:
    """How a prefiller is told to hand a prompt's KV to the decoder, and the decoder to take it."""

    name: ClassVar[str]
    needs_decoder_kv: ClassVar[bool]  # the decoders' KV receiver addresses are needed

    @staticmethod
    def prefill_params(client_params: Any, decoder_kv: str) -> dict[str, Any]:
        """The prefiller's ``kv_transfer_params`` (`client_params`: the client's own, if any)."""
        raise NotImplementedError

    @staticmethod
    def decode_body(raw: bytes, body: dict[str, Any], prefill_answer: bytes) -> bytes:
        """The decoder's body after the prefiller answered `prefill_answer` (200) to `body`
        (`raw` as the client sent it)."""
        return raw


class LMCachePush(KVHandoff):
    """The prefiller's LMCache connector pushes the KV to the decoder's receiver."""

    name = "lmcache"
    needs_decoder_kv = True

    @staticmethod
    def prefill_params(client_params: Any, decoder_kv: str) -> dict[str, Any]:
        return with_receiver(client_params, decoder_kv)


class NixlPull(KVHandoff):
    """vLLM's NixlConnector: the prefiller keeps the blocks, the decoder reads them."""

    name = "nixl"
    needs_decoder_kv = False

    @staticmethod
    def prefill_params(client_params: Any, decoder_kv: str) -> dict[str, Any]:
        own = client_params if isinstance(client_params, dict) else {}
        return {**own, "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}

    @staticmethod
    def decode_body(raw: bytes, body: dict[str, Any], prefill_answer: bytes) -> bytes:
        try:
            params = json.loads(prefill_answer).get("kv_transfer_params")
        except (ValueError, RecursionError, AttributeError):
            params = None
        if not isinstance(params, dict):
            return raw  # nothing to read from: the decoder prefills
        return json.dumps({**body, "kv_transfer_params": params}).encode()


HANDOFFS: dict[str, type[KVHandoff]] = {h.name: h for h in (LMCachePush, NixlPull)}


@dataclass
class ProxyConfig:
    """Backends are base URLs (``http://`` added when missing); `decoder_kv[i]` is the KV receiver
    (HOST:PORT) of `decoders[i]` (for the ``lmcache`` hand-off only). `backoff` is the first delay
    a failed backend is passed over for (doubling up to 30 s while it keeps failing)."""

    prefillers: tuple[str, ...]
    decoders: tuple[str, ...]
    decoder_kv: tuple[str, ...] = ()
    kv_protocol: str = LMCachePush.name
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_timeout: float = 600.0
    backoff: float = 1.0
    health_timeout: float = 2.0
    prefill_policy: str = "round-robin"
    stall_timeout: float = 10.0  # seconds with no answer (or next chunk) before /health is probed
    prefiller_kv_events: tuple[str, ...] = ()  # the prefillers' KV events endpoints, same order
    model: str | None = None  # the tokenizer's folder (kv-aware)
    shared_kv_events: tuple[str, ...] = ()  # of cache servers every prefiller is attached to (kv-aware)

    def __post_init__(self) -> None:
        self.prefillers = tuple(base_url("prefillers", url) for url in self.prefillers)
        self.decoders = tuple(base_url("decoders", url) for url in self.decoders)
        self.decoder_kv = tuple(_address("decoder_kv", a) for a in self.decoder_kv)
        if not self.prefillers or not self.decoders:
            raise ValueError("prefillers and decoders: at least one of each is needed")
        if self.kv_protocol not in HANDOFFS:
            raise ValueError(f"kv_protocol={self.kv_protocol!r}: expected one of {', '.join(HANDOFFS)}")
        if not HANDOFFS[self.kv_protocol].needs_decoder_kv:
            if self.decoder_kv:
                raise ValueError(f"decoder_kv: not used by the {self.kv_protocol} hand-off (the decoder "
                                 "reads the KV from the prefiller)")
        elif len(self.decoder_kv) != len(self.decoders):
            raise ValueError(f"decoder_kv: {len(self.decoder_kv)} KV address(es) for "
                             f"{len(self.decoders)} decoder(s); give one per decoder, in the same order")
        if self.prefill_policy not in POLICIES:
            raise ValueError(f"prefill_policy={self.prefill_policy!r}: expected one of {', '.join(POLICIES)}")
        if self.prefiller_kv_events and len(self.prefiller_kv_events) != len(self.prefillers):
            raise ValueError(f"prefiller_kv_events: {len(self.prefiller_kv_events)} endpoint(s) for "
                             f"{len(self.prefillers)} prefiller(s); give one per prefiller, in order")
        check_endpoints(self.prefiller_kv_events + self.shared_kv_events, connect=True)
        if POLICIES[self.prefill_policy].uses_tokens and not (self.prefiller_kv_events and self.model):
            raise ValueError(f"prefill_policy {self.prefill_policy} needs prefiller_kv_events and model")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port}: must be a TCP port (0 = any free one)")
        for name in ("prefill_timeout", "backoff", "health_timeout", "stall_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")

    @classmethod
    def parse(cls, prefillers: str, decoders: str, decoder_kv: str = "", kv_protocol: str | None = None,
              host: str = "127.0.0.1", port: int = 8000, prefill_timeout: float = 600.0,
              prefill_policy: str = "round-robin", prefiller_kv_events: str = "",
              model: str | None = None, shared_kv_events: str = "",
              stall_timeout: float = 10.0) -> ProxyConfig:
        """From the command line's comma-separated lists (`kv_protocol` None: the default)."""
        def split(value: str) -> tuple[str, ...]:
            return tuple(part.strip() for part in value.split(",") if part.strip())

        return cls(split(prefillers), split(decoders), split(decoder_kv), kv_protocol or LMCachePush.name,
                   host, port, prefill_timeout, prefill_policy=prefill_policy,
                   prefiller_kv_events=split(prefiller_kv_events), model=model,
                   shared_kv_events=split(shared_kv_events), stall_timeout=stall_timeout)


def _address(field: str, value: str) -> str:
    host, _, port = value.rpartition(":")
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{field}: {value!r} is not HOST:PORT")
    return value


def prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """What a prefiller is sent for the client's `body`: one token, not streamed, one choice, and
    `kv_transfer_params`."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=kv_transfer_params)
    for key in ("max_completion_tokens", "n"):
        if key in out:
            out[key] = 1
    return out


REQUEST_COST = 64  # kv-aware prefill: tokens a prefill in flight counts for besides its uncached prompt
PREFILLER_DOWN = "its requests go straight to a decoder"
DECODER_DOWN = "answered 503"


class RoundRobin:
    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self._next = 0

    def next_ready(self) -> Backend | None:
        """The next backend in turn that is not backing off (None if all are)."""
        n = len(self.backends)
        for i in range(self._next, self._next + n):
            if self.backends[i % n].backoff.ready():
                self._next = (i + 1) % n
                return self.backends[i % n]
        return None

    def next(self) -> Backend:
        """The next one not backing off, or if all are, the next in turn (someone must answer)."""
        ready = self.next_ready()
        if ready is not None:
            return ready
        chosen = self.backends[self._next]
        self._next = (self._next + 1) % len(self.backends)
        return chosen


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.handoff = HANDOFFS[config.kv_protocol]
        self.prefillers = RoundRobin([Backend("prefiller", url, config.backoff, PREFILLER_DOWN, logger)
                                      for url in config.prefillers])
        kv = config.decoder_kv or ("",) * len(config.decoders)
        self.decoders = RoundRobin([Backend("decoder", url, config.backoff, DECODER_DOWN, logger, address)
                                    for url, address in zip(config.decoders, kv, strict=True)])
        self.counters = Counters()
        self.client = ClientSession()
        self.stalls = StallWatch(self.client, config.stall_timeout, config.health_timeout)
        self.watch = KVWatch(config.prefillers, config.prefiller_kv_events, config.model,
                             shared=config.shared_kv_events)
        self.prefill_policy = POLICIES[config.prefill_policy](self.watch, REQUEST_COST)
        self.prefill_load = {url: Instance(url) for url in config.prefillers}

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        yield
        self.watch.close()

    def _pick_prefiller(self, routed: Routed) -> Backend | None:
        """The prefiller for `routed` among those not backing off (None if all are)."""
        if self.config.prefill_policy == "round-robin":
            return self.prefillers.next_ready()
        ready = {b.url: b for b in self.prefillers.backends if b.backoff.ready()}
        if not ready:
            return None
        return ready[self.prefill_policy.rank(routed, [self.prefill_load[url] for url in ready])[0].url]

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.client.session

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.counters.add("requests")
        raw = await request.read()
        try:
            body = json_object(raw)
        except ValueError as e:
            self.counters.add("bad_requests")
            return error_response(400, str(e))
        headers = passed_on(request)
        decoder = self.decoders.next()
        tokens = await self.watch.tokens(request.path, body) if self.prefill_policy.uses_tokens else None
        routed = Routed(session_of(request, body), tokens, request_keys(body))
        rejected, answer = await self._prefill(request.path, body, routed, decoder, headers)
        if rejected is not None:
            return rejected
        decode_body = raw if answer is None else self.handoff.decode_body(raw, body, answer)
        return await self._decode(request, decoder, decode_body, stream=bool(body.get("stream")))

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._decode(request, self.decoders.next(), None, stream=False)

    async def _prefill(self, path: str, body: dict[str, Any], routed: Routed, decoder: Backend,
                       headers: dict[str, str]) -> tuple[web.Response | None, bytes | None]:
        """(the prefiller's answer to relay when it rejected the request (4xx), None), or (None, its
        answer when it prefilled, else None: it failed or was skipped); the decoder is next unless
        rejected."""
        prefiller = self._pick_prefiller(routed)
        if prefiller is None:
            self.counters.add("prefill_skipped")
            return None, None
        prefiller.sent += 1
        timeout = self.config.prefill_timeout
        sent = prefill_body(body, self.handoff.prefill_params(body.get("kv_transfer_params"), decoder.kv))
        tokens = routed.tokens
        uncached = 0 if tokens is None else \
            len(tokens) - self.watch.match(prefiller.url, tokens, routed.keys).tokens
        try:
            with self.prefill_load[prefiller.url].serving(uncached), \
                    self.watch.sending(prefiller.url, tokens, routed.keys):
                posted = self.session.post(prefiller.url + path, json=sent, headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=timeout))
                async with await self.stalls.started(prefiller.url, posted) as r:
                    answer = await self.stalls.body(prefiller.url, r.content)
                    status, content_type = r.status, r.headers.get("Content-Type")
        except (aiohttp.ClientError, TimeoutError) as e:
            self.counters.add("prefill_failures")
            prefiller.failed(e if str(e) else f"no answer within {timeout} s")
            return None, None
        if status >= 500:
            self.counters.add("prefill_failures")
            prefiller.failed(f"HTTP {status}: {answer[:200].decode(errors='replace')}")
            return None, None
        prefiller.answered()
        if status >= 400:
            self.counters.add("prefill_rejected")
            return relayed(status, answer, content_type), None
        self.counters.add("prefilled")
        return None, answer

    async def _decode(self, request: web.Request, decoder: Backend, body: bytes | None,
                      stream: bool) -> web.StreamResponse:
        """Relays `decoder`'s answer to `request` (POSTing `body`, or GET when None) on the same path."""
        decoder.sent += 1
        headers = passed_on(request) | ({} if body is None else {"Content-Type": "application/json"})
        try:
            sent = self.session.request("GET" if body is None else "POST", decoder.url + request.path,
                                        data=body, headers=headers)
            async with await self.stalls.started(decoder.url, sent) as r:
                if stream and r.status == 200:
                    return await relay_stream(request, r, self._chunks(r, decoder))
                answer = await self.stalls.body(decoder.url, r.content)
        except aiohttp.ClientError as e:
            return error_response(503, self._decoder_failed(decoder, e))
        decoder.answered()
        return relayed(r.status, answer, r.headers.get("Content-Type"))

    async def _chunks(self, answer: aiohttp.ClientResponse, decoder: Backend) -> AsyncIterator[bytes]:
        """The decoder's stream as it arrives; if the decoder dies, an SSE error event ends it."""
        try:
            while chunk := await self.stalls.chunk(decoder.url, answer.content):
                yield chunk
        except aiohttp.ClientError as e:
            yield sse_error(503, self._decoder_failed(decoder, e))
            return
        decoder.answered()

    def _decoder_failed(self, decoder: Backend, error: BaseException) -> str:
        """Counts and logs it; the message for the client."""
        self.counters.add("decoder_failures")
        decoder.failed(error)
        return f"decoder {decoder.url} failed: {str(error) or type(error).__name__}"

    async def health(self, request: web.Request) -> web.Response:
        async def healthy(backend: Backend) -> dict[str, Any]:
            return {"url": backend.url,
                    "healthy": await health_of(self.session, backend.url, self.config.health_timeout)}

        prefillers = await asyncio.gather(*(healthy(b) for b in self.prefillers.backends))
        decoders = await asyncio.gather(*(healthy(b) for b in self.decoders.backends))
        ok = any(d["healthy"] for d in decoders)
        return web.json_response({"status": "ok" if ok else "unavailable", "prefillers": prefillers,
                                  "decoders": decoders}, status=200 if ok else 503)

    async def stats(self, request: web.Request) -> web.Response:
        counts: dict[str, Any] = {name: int(self.counters.get(name)) for name in COUNTERS}
        counts["prefillers"] = {b.url: b.sent for b in self.prefillers.backends}
        counts["decoders"] = {b.url: b.sent for b in self.decoders.backends}
        return web.json_response(counts)


PROXY = web.AppKey("proxy", Proxy)  # the app's proxy, for tests and embedders


def build_app(config: ProxyConfig) -> web.Application:
    proxy = Proxy(config)
    app = new_app(proxy.client)
    app[PROXY] = proxy
    app.cleanup_ctx.append(proxy.lifetime)
    app.router.add_post("/v1/completions", proxy.generate)
    app.router.add_post("/v1/chat/completions", proxy.generate)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/stats", proxy.stats)
    return app


async def start(config: ProxyConfig) -> web.AppRunner:
    """Serves in the running event loop until `await runner.cleanup()`; `runner.addresses` has the
    bound port (for ``port=0``)."""
    return await serve(build_app(config), config.host, config.port)


def run(config: ProxyConfig) -> None:
    """Serves until interrupted (the ``lmcache proxy`` command)."""
    logger.info("lmcache proxy on http://%s:%d (%s KV hand-off): prefillers %s, decoders %s%s", config.host,
                config.port, config.kv_protocol, ", ".join(config.prefillers), ", ".join(config.decoders),
                f" (KV at {', '.join(config.decoder_kv)})" if config.decoder_kv else "")
    web.run_app(build_app(config), host=config.host, port=config.port, print=None, handler_cancellation=True)
