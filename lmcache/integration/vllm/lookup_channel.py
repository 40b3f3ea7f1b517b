"""The scheduler asks the worker's engine how many prefix tokens are cached.

vLLM runs the scheduler and the workers in separate processes and the hot tier lives in each
worker, so lookups cross a local IPC channel over ``ipc://`` (pyzmq comes with vLLM): a REP
socket in each worker, a DEALER socket per rank in the scheduler. The socket's path names the
instance (`socket_path`): not by its ``engine_id`` alone, which is whatever the instance's
``--kv-transfer-config`` says and so may be the same for several instances on a host (whose
schedulers would then all ask the last one's workers, and fail to load what those hold).

Frames: request = [JSON header, int64 little-endian token ids]; reply = [JSON]. The header's
``id`` (an int the client picks) is echoed in the reply, so a late answer to an earlier request is
told apart. Commands:

- ``{"cmd": "lookup", "lease": id, "extra_key": str|None}`` -> ``{"hit": n}`` (pins the chunks
  counted under the lease);
- ``{"cmd": "release", "lease": id}`` -> ``{}`` (unpins them; an unknown lease is ignored);
- ``{"cmd": "stats"}`` -> ``EngineStats.report()``: ``{"engine": ..., "tiers": ...}``, and
  ``"kernels"``: which kernels vLLM runs (`cpu_build.describe`);
- ``{"cmd": "clear", "tier": "hot"|"disk"|"all"}`` -> ``{"cleared": {tier: chunks}}``;
- ``{"cmd": "ping"}`` -> ``{}``.

With tensor parallelism the client asks every rank at once and waits for all of them until one
deadline (`timeout`): a lookup takes as long as the slowest rank, not the sum. A rank that does not
answer in time, or answers an error or no token count, makes the lookup 0 hits; its socket is then
replaced (what it had not delivered yet is dropped), and the lease is released at once on every
rank: the ranks that answered confirm it before `lookup` returns, a rank still busy with the lookup
gets it right after.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash
import zmq

from lmcache.observability import IncidentLog

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any], np.ndarray], dict[str, Any]]
MAX_TOKENS = 1 << 22


def socket_path(vllm_config: Any, rank: int) -> str:
    """The lookup socket of worker `rank` of the instance (data-parallel replica) `vllm_config`
    describes: the same in its scheduler and its workers (vLLM's ``instance_id`` is made with the
    instance's config and travels with it to every process), different for every instance on the
    host. Hashed: an ``ipc://`` path holds about 100 bytes, an ``engine_id`` any number."""
    name = "\0".join((str(vllm_config.kv_transfer_config.engine_id), str(vllm_config.instance_id),
                      str(vllm_config.parallel_config.data_parallel_rank)))
    file = f"lmcache-{xxhash.xxh3_64_hexdigest(name.encode())}-{rank}.ipc"
    return f"ipc://{os.path.join(tempfile.gettempdir(), file)}"


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
            header: dict[str, Any] = {}
            try:
                header, tokens = _request(frames)
                reply = self._handler(header, tokens)
            except Exception as e:  # noqa: BLE001 - a bad request must not kill the server
                logger.warning("lookup request failed: %s", e)
                reply = {"error": str(e)}
            if "id" in header:
                reply = {**reply, "id": header["id"]}
            self._sock.send(json.dumps(reply).encode())

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
    """The scheduler's side: one DEALER socket per worker rank, all ranks asked at once."""

    def __init__(self, addresses: list[str], timeout: float) -> None:
        self.addresses = addresses
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket | None] = [None] * len(addresses)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._incidents = IncidentLog(logger, "LMCache lookup channel")

    def _socket(self, rank: int) -> zmq.Socket:
        sock = self._socks[rank]
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.addresses[rank])
            self._socks[rank] = sock
        return sock

    def _fail(self, rank: int, why: BaseException | str) -> None:
        """`rank` did not answer (or failed): a new socket for it, dropping what was not delivered."""
        sock = self._socks[rank]
        if sock is not None:
            sock.close(0)
            self._socks[rank] = None
        self._incidents.fail(why)

    def _send(self, rank: int, header: dict[str, Any], tokens: bytes | None) -> zmq.Socket | None:
        """Send a request to `rank` without waiting (None: it could not be sent, or the client is
        closed)."""
        if self._closed:
            return None
        frames = [b"", json.dumps(header).encode()] + ([tokens] if tokens is not None else [])
        sock = self._socket(rank)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._fail(rank, f"cannot send to {self.addresses[rank]}: {e}")
            return None
        return sock

    def _ask(self, ranks: list[int], header: dict[str, Any],
             tokens: bytes | None = None) -> dict[int, dict[str, Any] | None]:
        """Ask `ranks` at once and wait for their answers until one deadline; per rank its
        answer, or None (no answer in time, or an error)."""
        request_id = next(self._ids)
        header = {**header, "id": request_id}
        answers: dict[int, dict[str, Any] | None] = {}
        waiting: dict[zmq.Socket, int] = {}
        poller = zmq.Poller()
        for rank in ranks:
            sock = self._send(rank, header, tokens)
            if sock is None:
                answers[rank] = None
            else:
                waiting[sock] = rank
                poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(max(1, int(left * 1000))):
                reply = _reply(sock.recv_multipart())
                if reply.get("id") != request_id:
                    continue  # the late answer to an earlier request
                rank = waiting.pop(sock)
                poller.unregister(sock)
                if "error" in reply:
                    self._incidents.fail(f"{self.addresses[rank]}: {reply['error']}")
                    answers[rank] = None
                else:
                    answers[rank] = reply
        for rank in waiting.values():
            self._fail(rank, TimeoutError(f"no answer from {self.addresses[rank]} within {self.timeout:g} s"))
            answers[rank] = None
        if all(a is not None for a in answers.values()):
            self._incidents.recover()
        return answers

    def _all_ranks(self) -> list[int]:
        return list(range(len(self.addresses)))

    def lookup(self, lease: str, tokens: list[int], extra_key: str | None) -> int:
        """Prefix tokens cached on every rank (0 on any failure: then no rank keeps the lease)."""
        data = np.asarray(tokens, dtype="<i8").tobytes()
        with self._lock:
            answers = self._ask(self._all_ranks(), {"cmd": "lookup", "lease": lease, "extra_key": extra_key},
                                data)
            hits = [a.get("hit") for a in answers.values() if a is not None]
            counts = [h for h in hits if isinstance(h, int) and not isinstance(h, bool) and h >= 0]
            if len(counts) == len(answers):
                return min(counts, default=0)
            if len(counts) < len(hits):
                self._incidents.fail(f"a lookup answer without a token count: {hits}")
            self._release(lease, answered=[r for r, a in answers.items() if a is not None],
                          missing=[r for r, a in answers.items() if a is None])
        return 0

    def _release(self, lease: str, answered: list[int], missing: list[int]) -> None:
        """End `lease` on every rank: the ranks that `answered` its lookup confirm it; the `missing`
        ones get it without a wait (on their new socket: a rank still busy with the lookup ends
        the lease right after it)."""
        header = {"cmd": "release", "lease": lease}
        for rank in missing:
            self._send(rank, {**header, "id": next(self._ids)}, None)
        self._ask(answered, header)

    def clear(self, tier: str) -> bool:
        """Empty `tier` on every rank; False if a rank did not confirm."""
        with self._lock:
            answers = self._ask(self._all_ranks(), {"cmd": "clear", "tier": tier})
        return all(a is not None for a in answers.values())

    def stats(self) -> list[dict[str, Any] | None]:
        with self._lock:
            answers = self._ask(self._all_ranks(), {"cmd": "stats"})
        return [answers[rank] for rank in self._all_ranks()]

    def close(self) -> None:
        """Close the sockets; later requests are answered as misses."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sock in self._socks:
                if sock is not None:
                    sock.close(0)
            self._socks = [None] * len(self.addresses)
            self._ctx.term()


def _request(frames: list[bytes]) -> tuple[dict[str, Any], np.ndarray]:
    """The header and the token ids of a request's frames; ValueError if they are malformed."""
    if not 1 <= len(frames) <= 2:
        raise ValueError(f"expected 1 or 2 frames, got {len(frames)}")
    header = json.loads(frames[0])
    if not isinstance(header, dict):
        raise ValueError("header must be a JSON object")
    raw = frames[1] if len(frames) == 2 else b""
    if len(raw) % 8 or len(raw) // 8 > MAX_TOKENS:
        raise ValueError(f"token frame of {len(raw)} bytes is not a valid int64 array")
    return header, np.frombuffer(raw, dtype="<i8")


def _reply(frames: list[bytes]) -> dict[str, Any]:
    """A worker's answer as a DEALER receives it ([b"", JSON]); {} if it is not one (it then
    matches no request)."""
    try:
        reply = json.loads(frames[-1])
    except (IndexError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return reply if isinstance(reply, dict) else {}
