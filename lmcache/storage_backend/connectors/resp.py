"""Reading RESP2/RESP3 bulk-string replies (GET answers) straight from a Redis/Valkey socket.

redis-py parses a reply into a new `bytes` object, which the remote tier would then copy into the
arena. `RespBulkReply` lets values land in the arena directly, for one GET or for a pipeline of
them answered back to back:

- `header()` parses the next ``$<n>\\r\\n`` (None for a nil reply, RESP2's ``$-1`` or RESP3's
  ``_``; a simple error reply raises `ResponseError`);
- `readinto` then delivers exactly the `n` value bytes (a `ReadStream`), `skip_rest()` drops what
  the caller did not read, and `finish()` consumes the trailing ``\\r\\n``;
- bytes received past the current reply are kept for the next one; after the last expected
  reply, `check_drained()` makes sure none are left.

Anything unexpected, or a connection closed early, raises ConnectionError: the caller must then
drop the connection.
"""

from __future__ import annotations

import socket

from redis.exceptions import ResponseError

MAX_HEADER = 64


class RespBulkReply:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()  # bytes received but not consumed yet
        self.remaining = 0

    def _recv_more(self, n: int = MAX_HEADER) -> None:
        chunk = self._sock.recv(n)
        if not chunk:
            raise ConnectionError("connection closed in the middle of a reply")
        self._pending += chunk

    def header(self) -> int | None:
        while (end := self._pending.find(b"\r\n")) < 0:
            if len(self._pending) > MAX_HEADER:
                raise ConnectionError("malformed reply: no header line")
            self._recv_more()
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode(errors="replace"))
        if line == b"_":
            return None
        if line[:1] != b"$" or not line[1:].lstrip(b"-").isdigit():
            raise ConnectionError(f"unexpected reply {line[:20]!r} (expected a bulk string)")
        length = int(line[1:])
        if length < 0:
            return None
        self.remaining = length
        return length

    def readinto(self, buffer: memoryview, /) -> int:
        want = min(len(buffer), self.remaining)
        if want == 0:
            return 0
        if self._pending:
            n = min(want, len(self._pending))
            buffer[:n] = self._pending[:n]
            del self._pending[:n]
        else:
            n = self._sock.recv_into(buffer, want)
            if n == 0:
                raise ConnectionError("connection closed in the middle of a value")
        self.remaining -= n
        return n

    def skip_rest(self) -> None:
        scratch = memoryview(bytearray(min(self.remaining, 1 << 20)))
        while self.remaining:
            self.readinto(scratch[: self.remaining])

    def finish(self) -> None:
        if self.remaining:
            raise ConnectionError(f"{self.remaining} value bytes left unread")
        while len(self._pending) < 2:
            self._recv_more(2 - len(self._pending))  # never read past this reply
        if self._pending[:2] != b"\r\n":
            raise ConnectionError("malformed reply: bad value terminator")
        del self._pending[:2]

    def check_drained(self) -> None:
        if self._pending:
            raise ConnectionError(f"{len(self._pending)} unexpected bytes after the last reply")
