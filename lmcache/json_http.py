"""`JsonHTTPService`: a small HTTP service on its own threads whose endpoints take and return JSON
(the engine's controller, the cache server's operations endpoint).

Routes map (method, path) to a function of the JSON body that returns a JSON object, or a
`RawReply` (e.g. Prometheus text). Bad input — a body that is not a JSON object, or a route's
`BadRequest` / ValueError, a Content-Length that is not a byte count, JSON nested too deeply to
parse, a body shorter than its Content-Length — gets 400 with {"error": message}; an unknown path
404, a wrong method 405, a body over 16 MiB 413, a body that stalls for `timeout` seconds 408
(its connection closed: an idle client cannot hold a thread), a failing route 500 (the service
keeps serving).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)
MAX_BODY = 16 << 20
REQUEST_TIMEOUT = 30.0


class BadRequest(ValueError):
    """The request is malformed (answered 400)."""


class RawReply(NamedTuple):
    content_type: str
    body: bytes


Route = Callable[[dict[str, Any]], "dict[str, Any] | RawReply"]


class JsonHTTPService:
    def __init__(self, routes: Mapping[tuple[str, str], Route], host: str, port: int, name: str,
                 timeout: float = REQUEST_TIMEOUT) -> None:
        self._routes = dict(routes)
        self._name = name
        self.timeout = timeout
        self._http = ThreadingHTTPServer((host, port), _handler_for(self))
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True, name=f"lmcache-{name}")
        self._thread.start()
        logger.info("LMCache %s on http://%s:%d", name, host, self.port)

    def handle(self, method: str, path: str, raw: bytes) -> tuple[int, dict[str, Any] | RawReply]:
        """(HTTP status, JSON body or raw reply) for a request."""
        route = self._routes.get((method, path))
        if route is None:
            if any(p == path for _, p in self._routes):
                return HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{method} is not allowed on {path}"}
            paths = sorted({p for _, p in self._routes})
            return HTTPStatus.NOT_FOUND, {"error": f"no endpoint {path}; the endpoints are {paths}"}
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError as e:  # not JSON, not UTF-8, or an integer of more digits than Python parses
            return HTTPStatus.BAD_REQUEST, {"error": f"the body is not valid JSON: {e}"}
        except RecursionError:
            return HTTPStatus.BAD_REQUEST, {"error": "the body's JSON is nested too deeply"}
        if not isinstance(body, dict):
            return HTTPStatus.BAD_REQUEST, {"error": "the body must be a JSON object"}
        try:
            return HTTPStatus.OK, route(body)
        except ValueError as e:  # BadRequest, or input the service refused
            return HTTPStatus.BAD_REQUEST, {"error": str(e)}
        except Exception as e:  # the service must keep serving
            logger.exception("%s request %s %s failed", self._name, method, path)
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(5)


def fields(body: dict[str, Any], allowed: set[str], required: set[str] | None = None) -> None:
    """BadRequest unless `body` has only `allowed` fields and every `required` one."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted((required or set()) - set(body))
    if missing:
        raise BadRequest(f"missing field(s) {missing}")


def opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{name!r} must be a string")
    return value


def token_ids(body: dict[str, Any]) -> list[int]:
    """The body's ``tokens``: a non-empty list of token ids (BadRequest otherwise)."""
    ids = body["tokens"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and 0 <= t < 2**63 for t in ids):
        raise BadRequest("'tokens' must be a list of non-negative integer token ids")
    if not ids:
        raise BadRequest("the prompt is empty")
    return ids


def _handler_for(service: JsonHTTPService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = service.timeout  # of every read and write on the connection

        def _serve(self, method: str) -> None:
            declared = self.headers.get("Content-Length") or "0"
            if not (declared.isascii() and declared.isdigit()):
                error = f"Content-Length must be a byte count, got {declared}"
                self._reply(HTTPStatus.BAD_REQUEST, {"error": error})
                return
            length = int(declared) if len(declared) <= 18 else MAX_BODY + 1  # int() refuses 4,300+ digits
            if length > MAX_BODY:
                self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"body over {MAX_BODY} bytes"})
                return
            try:
                raw = self.rfile.read(length)
            except TimeoutError:
                self.close_connection = True
                error = f"the body did not arrive within {service.timeout:g} s"
                self._reply(HTTPStatus.REQUEST_TIMEOUT, {"error": error})
                return
            if len(raw) < length:
                error = f"the body ended after {len(raw)} of its {length} bytes"
                self._reply(HTTPStatus.BAD_REQUEST, {"error": error})
                return
            path = self.path.split("?", 1)[0]
            status, payload = service.handle(method, path, raw)
            self._reply(status, payload)

        def _reply(self, status: int, payload: dict[str, Any] | RawReply) -> None:
            if isinstance(payload, RawReply):
                content_type, data = payload
            else:
                content_type, data = "application/json", json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
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

        def do_PATCH(self) -> None:
            self._serve("PATCH")

        def do_OPTIONS(self) -> None:
            self._serve("OPTIONS")

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s: " + format, service._name, *args)

    return Handler
