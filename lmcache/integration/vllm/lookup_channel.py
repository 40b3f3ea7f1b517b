"""The scheduler asks the worker's engine how many prefix tokens are cached.

vLLM runs the scheduler and the workers in separate processes and the hot tier lives in each
worker, so lookups cross a local IPC channel: ZMQ REQ/REP over ``ipc://`` (pyzmq comes with vLLM).

Frames: request = [JSON header, int64 little-endian token ids]; reply = [JSON]. Commands:

- ``{"cmd": "lookup", "lease": id, "extra_key": str|None}`` -> ``{"hit": n}`` (pins the chunks
  counted under the lease);
- ``{"cmd": "stats"}`` -> ``EngineStats.report()``: ``{"engine": ..., "tiers": ...}``, and
  ``"kernels"``: which kernels vLLM runs (`cpu_build.describe`);
- ``{"cmd": "clear", "tier": "hot"|"disk"|"all"}`` -> ``{"cleared": {tier: chunks}}``;
- ``{"cmd": "ping"}`` -> ``{}``.

A client call that gets no answer within the timeout, or any error, counts as 0 hits; its socket
is then replaced (a REQ socket whose reply never came cannot send again). With tensor parallelism
the scheduler asks every rank and takes the minimum.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from lmcache.observability import IncidentLog

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any], np.ndarray], dict[str, Any]]
MAX_TOKENS = 1 << 22


def socket_path(engine_id: str, rank: int) -> str:
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'lmcache-{engine_id}-{rank}.ipc')}"


class LookupServer:
    """Answers lookups in a daemon thread of the worker process."""

    def __init__(self, address: str, handler: Handler) -> None:
        self.address = address
        self._handler = handler
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmcache-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            try:
                reply = self._answer(frames)
            except Exception as e:  # noqa: BLE001 - a bad request must not kill the server
                logger.warning("lookup request failed: %s", e)
                reply = {"error": str(e)}
            self._sock.send(json.dumps(reply).encode())

    def _answer(self, frames: list[bytes]) -> dict[str, Any]:
        if not 1 <= len(frames) <= 2:
            raise ValueError(f"expected 1 or 2 frames, got {len(frames)}")
        header = json.loads(frames[0])
        if not isinstance(header, dict):
            raise ValueError("header must be a JSON object")
        raw = frames[1] if len(frames) == 2 else b""
        if len(raw) % 8 or len(raw) // 8 > MAX_TOKENS:
            raise ValueError(f"token frame of {len(raw)} bytes is not a valid int64 array")
        return self._handler(header, np.frombuffer(raw, dtype="<i8"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._thread.is_alive():  # a socket must not be closed under its thread: leave it
            logger.warning("lookup server thread did not stop; leaving its socket to process exit")
        else:
            self._sock.close(0)
            self._ctx.term()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except FileNotFoundError:
                pass


class LookupClient:
    """The scheduler's side: one REQ socket per worker rank."""

    def __init__(self, addresses: list[str], timeout: float) -> None:
        self.addresses = addresses
        self.timeout_ms = int(timeout * 1000)
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket | None] = [None] * len(addresses)
        self._lock = threading.Lock()
        self._incidents = IncidentLog(logger, "LMCache lookup channel")

    def _socket(self, i: int) -> zmq.Socket:
        sock = self._socks[i]
        if sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.addresses[i])
            self._socks[i] = sock
        return sock

    def _ask(self, i: int, header: dict[str, Any], tokens: bytes | None) -> dict[str, Any] | None:
        sock = self._socket(i)
        try:
            frames = [json.dumps(header).encode()] + ([tokens] if tokens is not None else [])
            sock.send_multipart(frames)
            if not sock.poll(self.timeout_ms, zmq.POLLIN):
                raise TimeoutError(f"no answer from {self.addresses[i]} within {self.timeout_ms} ms")
            reply = json.loads(sock.recv())
        except Exception as e:  # noqa: BLE001 - a lookup that fails is a miss
            sock.close(0)
            self._socks[i] = None
            self._incidents.fail(e)
            return None
        if "error" in reply:
            self._incidents.fail(reply["error"])
            return None
        self._incidents.recover()
        return dict(reply)

    def lookup(self, lease: str, tokens: list[int], extra_key: str | None) -> int:
        """Prefix tokens cached on every rank (0 on any failure)."""
        data = np.asarray(tokens, dtype="<i8").tobytes()
        header = {"cmd": "lookup", "lease": lease, "extra_key": extra_key}
        with self._lock:
            hits = []
            for i in range(len(self.addresses)):
                reply = self._ask(i, header, data)
                if reply is None:
                    return 0
                hits.append(int(reply.get("hit", 0)))
        return min(hits) if hits else 0

    def clear(self, tier: str) -> bool:
        """Empty `tier` on every rank; False if a rank did not confirm."""
        with self._lock:
            replies = [self._ask(i, {"cmd": "clear", "tier": tier}, None) for i in range(len(self.addresses))]
        return all(r is not None for r in replies)

    def stats(self) -> list[dict[str, Any] | None]:
        with self._lock:
            return [self._ask(i, {"cmd": "stats"}, None) for i in range(len(self.addresses))]

    def close(self) -> None:
        with self._lock:
            for sock in self._socks:
                if sock is not None:
                    sock.close(0)
            self._socks = [None] * len(self.addresses)
        self._ctx.term()
