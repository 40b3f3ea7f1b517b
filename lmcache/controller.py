"""The engine's HTTP controller (opt-in `controller_url`): ask what is cached and where, clear
a tier, pin a prefix, check health, read counters. JSON in and out.

    GET  /health  -> {"status": "ok" | "degraded", "tiers": {tier: works}}
    GET  /stats   -> {"engine": {counter: value}, "tiers": {tier: {"counters": {...}, "gauges": {...}}}}
    POST /lookup  {"tokens": [int, ...] | "text": str, "extra_key"?: str}
                  -> {"tokens": n, "cached_tokens": prefix cached in any tier,
                      "tiers": {tier: prefix cached in that tier alone},
                      "peers": {address: prefix that peer holds}}
    POST /clear   {"tier": "hot" | "disk" | "all"} -> {"cleared": {tier: chunks dropped}}
    POST /pin     {"tokens" | "text", "extra_key"?, "ttl"?: seconds (default 3600)}
                  -> {"pinned_tokens": n, "lease": id}: the cached prefix stays cached (in
                  whichever tier holds it) until unpinned or the ttl ends
    POST /unpin   {"tokens" | "text", "extra_key"?} or {"lease": id} -> {"released": id}

"text" needs a tokenizer (`tokenize`, set by the integration that knows the model). Bad input —
a body that is not a JSON object, unknown or missing fields, wrong types — gets 400 with
{"error": message}; an unknown path 404, a wrong method 405, a body over 16 MiB 413. The
server binds to `controller_url`'s host (loopback unless configured), on its own threads.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import torch
import xxhash

from lmcache.observability import EngineStats
from lmcache.storage_backend.peer_backend import PeerBackend
from lmcache.storage_backend.storage_manager import StorageManager
from lmcache.token_database import TokenDatabase

logger = logging.getLogger(__name__)
MAX_BODY = 16 << 20
DEFAULT_PIN_TTL = 3600.0


class BadRequest(ValueError):
    """The request is malformed (answered 400)."""


class ControlledEngine(Protocol):
    """What the controller uses of an engine (`LMCacheEngine` is one)."""

    storage_manager: StorageManager
    token_database: TokenDatabase
    stats: EngineStats

    def lookup(self, tokens: torch.Tensor, search_range: str | list[str] | None = None, *,
               extra_key: str | None = None, lease_id: str | None = None, lease_ttl: float = 60.0) -> int: ...

    def release(self, lease_id: str) -> None: ...


class Controller:
    def __init__(self, engine: ControlledEngine, host: str, port: int,
                 tokenize: Callable[[str], list[int]] | None = None) -> None:
        self.engine = engine
        self.tokenize = tokenize
        self._routes: dict[tuple[str, str], Callable[[dict[str, Any]], dict[str, Any]]] = {
            ("GET", "/health"): self.health, ("GET", "/stats"): self.stats,
            ("POST", "/lookup"): self.lookup, ("POST", "/clear"): self.clear,
            ("POST", "/pin"): self.pin, ("POST", "/unpin"): self.unpin,
        }
        self._http = ThreadingHTTPServer((host, port), _handler_for(self))
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True,
                                        name="lmcache-controller")
        self._thread.start()
        logger.info("LMCache controller on http://%s:%d", host, self.port)

    # ---- endpoints --------------------------------------------------------------------------------

    def health(self, body: dict[str, Any]) -> dict[str, Any]:
        _fields(body, set())
        tiers = self.engine.storage_manager.health()
        return {"status": "ok" if all(tiers.values()) else "degraded", "tiers": tiers}

    def stats(self, body: dict[str, Any]) -> dict[str, Any]:
        _fields(body, set())
        return self.engine.stats.report()

    def lookup(self, body: dict[str, Any]) -> dict[str, Any]:
        _fields(body, {"tokens", "text", "extra_key"})
        tokens, extra_key = self._tokens(body), _opt_str(body, "extra_key")
        sm = self.engine.storage_manager
        per_tier = {t.name: self.engine.lookup(tokens, t.name, extra_key=extra_key) for t in sm.tiers}
        chunks = list(self.engine.token_database.process_tokens(tokens, extra_key=extra_key))
        peers: dict[str, int] = {}
        for tier in sm.tiers:
            if isinstance(tier, PeerBackend):
                holders = tier.lookup.holders([key for _, _, key in chunks])
                for peer in sorted({p for h in holders for p in h}):
                    held = next((i for i, h in enumerate(holders) if peer not in h), len(holders))
                    peers[peer] = chunks[held - 1][1] if held else 0
        cached = self.engine.lookup(tokens, extra_key=extra_key)
        return {"tokens": int(tokens.shape[0]), "cached_tokens": cached, "tiers": per_tier, "peers": peers}

    def clear(self, body: dict[str, Any]) -> dict[str, Any]:
        _fields(body, {"tier"}, required={"tier"})
        which = body["tier"]
        if which not in self.engine.storage_manager.CLEARABLE:
            raise BadRequest(f"'tier' must be one of {list(self.engine.storage_manager.CLEARABLE)}, "
                             f"got {which!r}")
        return {"cleared": self.engine.storage_manager.clear(which)}

    def pin(self, body: dict[str, Any]) -> dict[str, Any]:
        _fields(body, {"tokens", "text", "extra_key", "ttl"})
        tokens, extra_key = self._tokens(body), _opt_str(body, "extra_key")
        ttl = body.get("ttl", DEFAULT_PIN_TTL)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise BadRequest(f"'ttl' must be a number of seconds > 0, got {ttl!r}")
        lease = _pin_id(tokens, extra_key)
        hit = self.engine.lookup(tokens, extra_key=extra_key, lease_id=lease, lease_ttl=float(ttl))
        return {"pinned_tokens": hit, "lease": lease}

    def unpin(self, body: dict[str, Any]) -> dict[str, Any]:
        _fields(body, {"tokens", "text", "extra_key", "lease"})
        if "lease" in body:
            if set(body) != {"lease"} or not isinstance(body["lease"], str):
                raise BadRequest("give either 'lease' (a string) alone, or 'tokens' / 'text'")
            lease = body["lease"]
        else:
            lease = _pin_id(self._tokens(body), _opt_str(body, "extra_key"))
        self.engine.release(lease)
        return {"released": lease}

    # ---- helpers ----------------------------------------------------------------------------------

    def _tokens(self, body: dict[str, Any]) -> torch.Tensor:
        if ("tokens" in body) == ("text" in body):
            raise BadRequest("give exactly one of 'tokens' (a list of token ids) or 'text'")
        if "text" in body:
            if not isinstance(body["text"], str):
                raise BadRequest("'text' must be a string")
            if self.tokenize is None:
                raise BadRequest("this controller has no tokenizer: send 'tokens'")
            ids: Any = self.tokenize(body["text"])
        else:
            ids = body["tokens"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                    and 0 <= t < 2**63 for t in ids):
                raise BadRequest("'tokens' must be a list of non-negative integer token ids")
        if not ids:
            raise BadRequest("the prompt is empty")
        return torch.tensor(ids, dtype=torch.int64)

    def handle(self, method: str, path: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) for a request."""
        route = self._routes.get((method, path))
        if route is None:
            if any(p == path for _, p in self._routes):
                return HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{method} is not allowed on {path}"}
            paths = sorted({p for _, p in self._routes})
            return HTTPStatus.NOT_FOUND, {"error": f"no endpoint {path}; the endpoints are {paths}"}
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return HTTPStatus.BAD_REQUEST, {"error": f"the body is not valid JSON: {e}"}
        if not isinstance(body, dict):
            return HTTPStatus.BAD_REQUEST, {"error": "the body must be a JSON object"}
        try:
            return HTTPStatus.OK, route(body)
        except ValueError as e:  # BadRequest, or input the engine refused
            return HTTPStatus.BAD_REQUEST, {"error": str(e)}
        except Exception as e:  # the controller must keep serving
            logger.exception("controller request %s %s failed", method, path)
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(5)


def _fields(body: dict[str, Any], allowed: set[str], required: set[str] | None = None) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted((required or set()) - set(body))
    if missing:
        raise BadRequest(f"missing field(s) {missing}")


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{name!r} must be a string")
    return value


def _pin_id(tokens: torch.Tensor, extra_key: str | None) -> str:
    digest = xxhash.xxh3_64_hexdigest(tokens.numpy().tobytes() + (extra_key or "").encode())
    return f"pin:{digest}"


def _handler_for(controller: Controller) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"body over {MAX_BODY} bytes"})
                return
            path = self.path.split("?", 1)[0]
            status, payload = controller.handle(method, path, self.rfile.read(length))
            self._reply(status, payload)

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("controller: " + format, *args)

    return Handler
