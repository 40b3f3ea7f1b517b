"""`LMCacheClient`: blocking client of the lm:// server, safe to share between threads.

It keeps a few idle connections (each call borrows one, so concurrent callers never interleave
frames). It has no backoff of its own: a call whose server does not answer raises, and backing
off is the caller's failure domain's (`lmcache.failures`). A call that fails on a reused connection
(e.g. the server restarted since) is retried once on a fresh one. Errors: ConnectionError /
TimeoutError (transport), PermissionError (bad auth token), `LMServerError` (the server refused
the request; `ValueTooLargeError` for a PUT larger than the server's capacity, which is also a
`failures.TooLarge`: the store has no room for it, it did not fail), ValueError (bad arguments,
e.g. an oversize key).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lmcache.failures import TooLarge
from lmcache.server import protocol
from lmcache.server.protocol import Op, Status
from lmcache.write_parts import Buffer, Parts, nbytes_of

T = TypeVar("T")
X = TypeVar("X")


class LMServerError(RuntimeError):
    """The server answered a request with an error status."""


class ValueTooLargeError(LMServerError, TooLarge):
    """The server refused a PUT whose value is larger than its capacity (TOO_LARGE)."""


class LMCacheClient:
    def __init__(self, host: str, port: int, *, timeout: float = 5.0, auth_token: str | None = None,
                 max_idle: int = 8) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.auth_token = auth_token.encode() if auth_token else None
        self.max_idle = max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    # ---- public API -----------------------------------------------------------------------------

    def put(self, key: str, value: Buffer | Parts) -> None:
        """Store `value` (bytes, or parts sent in order without joining them: `write_parts`)."""
        parts = [value] if isinstance(value, (bytes, bytearray, memoryview)) else value
        status, _ = self._call([(Op.PUT, key, parts)])[0]
        if status == Status.TOO_LARGE:
            raise ValueTooLargeError(f"value for {key!r} is larger than the server's capacity")

    def get(self, key: str) -> bytearray | None:
        return self.get_many([key])[0]

    def get_into(self, key: str, read: Callable[[SocketStream, int], T]) -> T | None:
        """GET that hands the value to `read(stream, length)` as it arrives on the socket (no
        intermediate buffer); None if the key is missing. See `get_many_into`."""
        return self.get_many_into([key], lambda _, stream, length: read(stream, length))[0]

    def get_many(self, keys: Sequence[str]) -> list[bytearray | None]:
        """Pipelined GETs: all requests are sent, then the answers read in order."""
        if not keys:
            return []
        answers = self._call([(Op.GET, k, ()) for k in keys])
        return [value if status == Status.OK else None for status, value in answers]

    def get_many_into(self, keys: Sequence[str],
                      read: Callable[[int, SocketStream, int], T]) -> list[T | None]:
        """Pipelined GETs whose values go from the socket straight into `read(i, stream, length)`
        (for `keys[i]`), one after another (None for missing keys). `read` may leave part of a
        value unread (it is skipped); if `read` raises, the connection is closed and the error propagates."""
        if not keys:
            return []
        requests = b"".join(protocol.pack_request(Op.GET, k.encode(), 0) for k in keys)

        def exchange(sock: socket.socket) -> list[T | None]:
            sock.sendall(requests)
            out: list[T | None] = []
            for i in range(len(keys)):
                status, value_len = protocol.unpack_response(bytes(_recv_exact(sock, protocol.HEADER_SIZE)))
                if status != Status.OK:
                    self._check_status(status, _recv_exact(sock, value_len) if value_len else bytearray())
                    out.append(None)
                    continue
                stream = SocketStream(sock, value_len)
                out.append(read(i, stream, value_len))
                stream.skip_rest()
            return out

        sock, answers = self._exchange(exchange)
        self._give_back(sock)
        return answers

    def exists(self, key: str) -> bool:
        return self._call([(Op.EXISTS, key, ())])[0][0] == Status.OK

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Pipelined EXISTS."""
        if not keys:
            return []
        return [status == Status.OK for status, _ in self._call([(Op.EXISTS, k, ()) for k in keys])]

    def delete(self, key: str) -> bool:
        return self._call([(Op.DELETE, key, ())])[0][0] == Status.OK

    def list_keys(self, prefix: str = "") -> list[str]:
        _, value = self._call([(Op.LIST, prefix, ())])[0]
        return [k.decode() for k in protocol.unpack_key_list(value)]

    def health(self) -> dict[str, Any]:
        _, value = self._call([(Op.HEALTH, "", ())])[0]
        return json.loads(value)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # ---- transport ------------------------------------------------------------------------------

    def _call(self, requests: list[tuple[Op, str, Parts]]) -> list[tuple[Status, bytearray]]:
        frames = [(protocol.pack_request(op, key.encode(), nbytes_of(parts)), parts)
                  for op, key, parts in requests]

        def send_all(sock: socket.socket) -> list[tuple[Status, bytearray]]:
            for head, parts in frames:
                sock.sendall(head)
                for part in parts:
                    sock.sendall(part)
            return [self._read_answer(sock) for _ in frames]

        sock, answers = self._exchange(send_all)
        self._give_back(sock)
        return answers

    def _exchange(self, exchange: Callable[[socket.socket], X]) -> tuple[socket.socket, X]:
        """Run `exchange` on a pooled connection, once more on a fresh one if a reused connection
        turns out stale. Returns the (still borrowed) socket and the result; on an error the socket
        is closed."""
        for attempt in range(2):
            sock, reused = self._borrow() if attempt == 0 else (self._connect(), False)
            try:
                return sock, exchange(sock)
            except (ConnectionError, EOFError) as e:
                sock.close()
                if reused:
                    continue  # a stale pooled connection: retry once on a fresh one
                raise ConnectionError(f"lm://{self.host}:{self.port}: {e}") from e
            except BaseException:
                sock.close()
                raise
        raise AssertionError("unreachable")

    def _read_answer(self, sock: socket.socket) -> tuple[Status, bytearray]:
        status, value_len = protocol.unpack_response(bytes(_recv_exact(sock, protocol.HEADER_SIZE)))
        value = _recv_exact(sock, value_len) if value_len else bytearray()
        self._check_status(status, value)
        return status, value

    def _check_status(self, status: Status, value: bytearray) -> None:
        if status == Status.ERROR:
            raise LMServerError(value.decode(errors="replace"))
        if status == Status.UNAUTHORIZED:
            raise PermissionError(f"lm://{self.host}:{self.port} rejected the auth token")

    def _borrow(self) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(sock)
                return
        sock.close()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.auth_token is not None:
            try:
                sock.sendall(protocol.pack_request(Op.AUTH, self.auth_token))
                self._read_answer(sock)
            except BaseException:
                sock.close()
                raise
        return sock


class SocketStream:
    """The next `length` bytes of a connection, read on demand (`readinto`). A connection that
    closes early raises ConnectionError: a transport fault, never a corrupt value."""

    def __init__(self, sock: socket.socket, length: int) -> None:
        self._sock = sock
        self.remaining = length

    def readinto(self, buffer: memoryview, /) -> int:
        want = min(len(buffer), self.remaining)
        if want == 0:
            return 0
        got = self._sock.recv_into(buffer, want)
        if got == 0:
            raise ConnectionError("connection closed by the server in the middle of a value")
        self.remaining -= got
        return got

    def skip_rest(self) -> None:
        """Read and drop what is left of the value."""
        scratch = memoryview(bytearray(min(self.remaining, 1 << 20)))
        while self.remaining:
            self.readinto(scratch[: self.remaining])


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise EOFError("connection closed by the server")
        view = view[got:]
    return buf
