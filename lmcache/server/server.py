"""lm:// servers: asyncio, one coroutine per connection, frames from `protocol`.

`FrameServer` holds the protocol (limits, authentication, per-op counts for HEALTH) and leaves
answering requests to subclasses: `LMCacheServer`, the shared cache server, and the engines' own
read-only peer servers (`lmcache.p2p.peer_server`). `ServerThread` runs one inside another process.

`lmcache server --host 127.0.0.1 --port 65432 [--max-size-gb N] [--auth-token T]` runs
`serve()` with an `LMCacheServer`. Limits: keys of at most `protocol.MAX_KEY_BYTES`, values of at
most `max_value_bytes` (a larger frame gets an ERROR and its connection is closed),
`capacity_bytes` in total (least recently used entries are evicted). A connection may stay idle
between frames for any time, but once a frame has started (its first byte), the rest of its header
and then its key and value must each arrive within `frame_timeout` seconds (a stalled sender is
disconnected). A request whose answer fails (the subclass raised) gets an ERROR naming the failure,
counted in `num_failed_requests` and logged once per incident; its connection keeps serving.
With `auth_token`, every connection must AUTH first. SIGTERM / SIGINT close the listener and all
connections and return.
"""

from __future__ import annotations

import abc
import asyncio
import hmac
import json
import logging
import signal
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from lmcache.observability import IncidentLog
from lmcache.server import protocol
from lmcache.server.lru_store import LRUByteStore
from lmcache.server.protocol import Op, ProtocolError, Status
from lmcache.write_parts import Buffer

logger = logging.getLogger(__name__)
HANDLER_GRACE = 2.0  # seconds a closing `ServerThread` lets the requests being answered finish


class Reply(NamedTuple):
    """An answer: `status`, the value as `parts` (sent in order), and `release`, called once the
    parts have been handed to the transport (e.g. to drop a reference on the memory they view)."""

    status: Status
    parts: Sequence[Buffer] = ()
    release: Callable[[], None] | None = None


class FrameServer(abc.ABC):
    """Serves lm:// frames (one coroutine per connection); subclasses answer requests in
    `dispatch` and describe themselves in `info` (HEALTH adds the requests served by op). With
    `blocking_dispatch`, `dispatch` runs on a worker thread (it may do I/O) instead of the loop."""

    blocking_dispatch = False

    def __init__(self, *, auth_token: str | None = None,
                 max_value_bytes: int = protocol.DEFAULT_MAX_VALUE_BYTES, frame_timeout: float = 30.0,
                 ) -> None:
        self.auth_token = auth_token.encode() if auth_token else None
        self.max_value_bytes = max_value_bytes
        self.frame_timeout = frame_timeout
        self.num_bad_frames = 0
        self.num_failed_requests = 0  # requests answered with ERROR because answering raised
        self._failures = IncidentLog(logger, f"{type(self).__name__} requests", with_traceback=True,
                                     consequence="answered with an error")
        self.op_counts: Counter[str] = Counter()  # requests served, by op (reported by HEALTH)
        self._writers: set[asyncio.StreamWriter] = set()

    @abc.abstractmethod
    def dispatch(self, op: Op, key: bytes, value: bytes) -> Reply: ...

    def info(self) -> dict[str, Any]:
        return {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        authed = self.auth_token is None
        try:
            while True:
                try:
                    first = await reader.readexactly(1)  # idle between frames: no time limit
                except asyncio.IncompleteReadError:
                    return  # the client closed the connection between frames
                head = first + await asyncio.wait_for(reader.readexactly(protocol.HEADER_SIZE - 1),
                                                      self.frame_timeout)
                op, key_len, value_len = protocol.unpack_request(head, self.max_value_bytes)
                if not authed and op != Op.AUTH:
                    writer.write(protocol.pack_response(Status.UNAUTHORIZED))
                    await writer.drain()
                    return
                key = await asyncio.wait_for(reader.readexactly(key_len), self.frame_timeout)
                value = (await asyncio.wait_for(reader.readexactly(value_len), self.frame_timeout)
                         if value_len else b"")
                if not authed:
                    authed = op == Op.AUTH and hmac.compare_digest(key, self.auth_token or b"")
                    writer.write(protocol.pack_response(Status.OK if authed else Status.UNAUTHORIZED))
                    await writer.drain()
                    if not authed:
                        return
                    continue
                self.op_counts[op.name] += 1
                reply = await self._answer_or_error(op, key, value)
                try:
                    writer.write(protocol.pack_response(reply.status, sum(memoryview(p).nbytes
                                                                          for p in reply.parts)))
                    for part in reply.parts:
                        writer.write(part)  # sent now, or copied into the transport's buffer
                finally:
                    if reply.release is not None:
                        reply.release()
                await writer.drain()
        except ProtocolError as e:
            self.num_bad_frames += 1
            logger.warning("closing connection from %s: %s", writer.get_extra_info("peername"), e)
            message = str(e).encode()
            writer.write(protocol.pack_response(Status.ERROR, len(message)) + message)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            self.num_bad_frames += 1
            logger.info("dropping connection from %s mid-frame: %r", writer.get_extra_info("peername"), e)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer_or_error(self, op: Op, key: bytes, value: bytes) -> Reply:
        """`_answer`, or an ERROR reply naming the failure if answering raised (the frame was read
        whole: the connection keeps serving)."""
        try:
            reply = await self._answer(op, key, value)
        except Exception as e:  # noqa: BLE001 - one failing request must not drop the connection
            self.num_failed_requests += 1
            self._failures.fail(e)
            return Reply(Status.ERROR, [f"{op.name} failed: {e}".encode()[: protocol.MAX_MESSAGE_BYTES]])
        self._failures.recover()
        return reply

    async def _answer(self, op: Op, key: bytes, value: bytes) -> Reply:
        if op == Op.HEALTH:
            return Reply(Status.OK, [json.dumps({**self.info(), "ops": dict(self.op_counts)}).encode()])
        if op == Op.AUTH:
            return Reply(Status.OK)  # on an authenticated (or open) connection
        if self.blocking_dispatch:
            return await asyncio.get_running_loop().run_in_executor(None, self.dispatch, op, key, value)
        return self.dispatch(op, key, value)

    def close_connections(self) -> None:
        for writer in list(self._writers):
            writer.close()


class LMCacheServer(FrameServer):
    """The shared cache server: an LRU byte store of `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, *, auth_token: str | None = None,
                 max_value_bytes: int = protocol.DEFAULT_MAX_VALUE_BYTES,
                 frame_timeout: float = 30.0) -> None:
        super().__init__(auth_token=auth_token, max_value_bytes=max_value_bytes, frame_timeout=frame_timeout)
        self.store = LRUByteStore(capacity_bytes)

    def info(self) -> dict[str, Any]:
        return {"items": len(self.store), "bytes": self.store.used, "capacity": self.store.capacity}

    def dispatch(self, op: Op, key: bytes, value: bytes) -> Reply:
        if op == Op.GET:
            found = self.store.get(key)
            return Reply(Status.NOT_FOUND) if found is None else Reply(Status.OK, [found])
        if op == Op.PUT:
            return Reply(Status.OK if self.store.put(key, value) else Status.TOO_LARGE)
        if op == Op.EXISTS:
            return Reply(Status.OK if self.store.contains(key) else Status.NOT_FOUND)
        if op == Op.DELETE:
            return Reply(Status.OK if self.store.delete(key) else Status.NOT_FOUND)
        if op == Op.LIST:
            return Reply(Status.OK, [protocol.pack_key_list(self.store.keys(key))])
        raise ProtocolError(f"unexpected op {op.name}")


async def serve(host: str, port: int, server: LMCacheServer) -> None:
    """Serve until SIGTERM/SIGINT; prints ``listening on HOST:PORT`` once bound (port 0 = any)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the port opens: a supervisor's first
        loop.add_signal_handler(sig, stop.set)  # SIGTERM then stops it cleanly too
    listener = await asyncio.start_server(server.handle, host, port)
    bound = listener.sockets[0].getsockname()
    print(f"lmcache server listening on {bound[0]}:{bound[1]}", flush=True)
    async with listener:
        await stop.wait()
        listener.close()
        server.close_connections()
        await listener.wait_closed()
    logger.info("lmcache server on %s:%s stopped", bound[0], bound[1])


class ServerThread:
    """Runs a `FrameServer` on its own event loop in a daemon thread (for servers that live
    inside another process, e.g. an engine's peer server). `port` is the bound port."""

    def __init__(self, server: FrameServer, host: str, port: int) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._listener: asyncio.Server | None = None
        self.host = host
        self.port = 0
        self._thread = threading.Thread(target=self._run, args=(host, port), daemon=True,
                                        name=f"lmcache-{type(server).__name__}")
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            start = asyncio.start_server(self.server.handle, host, port)
            self._listener = self._loop.run_until_complete(start)
            self.port = self._listener.sockets[0].getsockname()[1]
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            self._error = e
            self._started.set()
            self._loop.close()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._shut_down(self._listener))
        self._loop.close()

    async def _shut_down(self, listener: asyncio.Server) -> None:
        """Stop listening and close every connection; the requests being answered then finish
        (within `HANDLER_GRACE` seconds, else they are cancelled), so each releases what its answer
        holds (a closed loop would drop them midway)."""
        listener.close()
        self.server.close_connections()
        await listener.wait_closed()
        handlers = asyncio.all_tasks() - {asyncio.current_task()}
        if handlers:
            _, late = await asyncio.wait(handlers, timeout=HANDLER_GRACE)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def close(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
