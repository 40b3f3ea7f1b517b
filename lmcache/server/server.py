"""The lm:// cache server: asyncio, one coroutine per connection, frames from `protocol`.

`lmcache server --host 127.0.0.1 --port 65432 [--max-size-gb N] [--auth-token T]` runs
`serve()`. Limits: keys of at most `protocol.MAX_KEY_BYTES`, values of at most `max_value_bytes`
(a larger frame gets an ERROR and its connection is closed), `capacity_bytes` in total (least
recently used entries are evicted). Once a frame has started, its remaining bytes must arrive
within `frame_timeout` seconds (a stalled sender is disconnected). With `auth_token`, every
connection must AUTH first. SIGTERM / SIGINT close the listener and all connections and return.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
from collections import Counter

from lmcache.server import protocol
from lmcache.server.lru_store import LRUByteStore
from lmcache.server.protocol import Op, ProtocolError, Status

logger = logging.getLogger(__name__)


class LMCacheServer:
    def __init__(self, capacity_bytes: int, *, auth_token: str | None = None,
                 max_value_bytes: int = protocol.DEFAULT_MAX_VALUE_BYTES,
                 frame_timeout: float = 30.0) -> None:
        self.store = LRUByteStore(capacity_bytes)
        self.auth_token = auth_token.encode() if auth_token else None
        self.max_value_bytes = max_value_bytes
        self.frame_timeout = frame_timeout
        self.num_bad_frames = 0
        self.op_counts: Counter[str] = Counter()  # requests served, by op (reported by HEALTH)
        self._writers: set[asyncio.StreamWriter] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        authed = self.auth_token is None
        try:
            while True:
                try:
                    head = await reader.readexactly(protocol.HEADER_SIZE)
                except asyncio.IncompleteReadError:
                    return  # the client closed the connection between frames
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
                status, out = self.dispatch(op, key, value)
                writer.write(protocol.pack_response(status, len(out)))
                if out:
                    writer.write(out)
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

    def dispatch(self, op: Op, key: bytes, value: bytes) -> tuple[Status, bytes]:
        self.op_counts[op.name] += 1
        if op == Op.GET:
            found = self.store.get(key)
            return (Status.NOT_FOUND, b"") if found is None else (Status.OK, found)
        if op == Op.PUT:
            return (Status.OK if self.store.put(key, value) else Status.TOO_LARGE), b""
        if op == Op.EXISTS:
            return (Status.OK if self.store.contains(key) else Status.NOT_FOUND), b""
        if op == Op.DELETE:
            return (Status.OK if self.store.delete(key) else Status.NOT_FOUND), b""
        if op == Op.LIST:
            return Status.OK, protocol.pack_key_list(self.store.keys(key))
        if op == Op.HEALTH:
            info = {"items": len(self.store), "bytes": self.store.used, "capacity": self.store.capacity,
                    "ops": dict(self.op_counts)}
            return Status.OK, json.dumps(info).encode()
        return Status.OK, b""  # AUTH on an authenticated (or open) connection

    def close_connections(self) -> None:
        for writer in list(self._writers):
            writer.close()


async def serve(host: str, port: int, server: LMCacheServer) -> None:
    """Serve until SIGTERM/SIGINT; prints ``listening on HOST:PORT`` once bound (port 0 = any)."""
    listener = await asyncio.start_server(server.handle, host, port)
    bound = listener.sockets[0].getsockname()
    print(f"lmcache server listening on {bound[0]}:{bound[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with listener:
        await stop.wait()
        listener.close()
        server.close_connections()
        await listener.wait_closed()
    logger.info("lmcache server on %s:%s stopped", bound[0], bound[1])
