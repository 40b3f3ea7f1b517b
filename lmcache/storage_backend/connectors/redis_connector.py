"""redis:// rediss:// valkey:// valkeys:// — one Redis/Valkey server through redis-py.

`RedisClientConnector` holds the operations shared by every redis-py client (standalone,
sentinel, cluster): GET, MGET for batches, SET with the optional `ttl`, EXISTS, DELETE. The
standalone connector also reads GET replies, single or pipelined, straight into the arena
(`resp.RespBulkReply`); EXISTS batches are pipelined. Clients are
built without redis-py's own retries (a dead server must cost one quick failure; the remote tier
does the backing off) and with `remote_timeout` as connect and socket timeout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import chain
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

from lmcache.storage_backend.connectors.base import Buffer, RemoteConnector, T
from lmcache.storage_backend.connectors.resp import RespBulkReply
from lmcache.storage_backend.connectors.url import RemoteURL
from lmcache.storage_backend.serde.blob_stream import ReadStream
from lmcache.write_parts import Parts, nbytes_of

REDIS_OPTIONS = frozenset({"ttl", "max_connections"})
TLS_OPTIONS = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
                         "ssl_check_hostname"})
TLS_SCHEMES = ("rediss", "valkeys")


def client_kwargs(url: RemoteURL, timeout: float) -> dict[str, Any]:
    """redis-py keyword arguments shared by every redis-family scheme."""
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout, "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0), "username": url.username, "password": url.password,
    }
    if url.scheme in TLS_SCHEMES:
        kwargs["ssl"] = True
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
            if name in url.options:
                kwargs[name] = url.options[name]
        if "ssl_check_hostname" in url.options:
            kwargs["ssl_check_hostname"] = url.options["ssl_check_hostname"].lower() in ("1", "true", "yes")
    return kwargs


def db_number(url: RemoteURL, index: int) -> int:
    if len(url.path) <= index:
        return 0
    if not url.path[index].isdigit():
        raise ValueError(f"remote_url {url.url!r}: database {url.path[index]!r} must be a number")
    return int(url.path[index])


@contextmanager
def borrowed(pool: Any) -> Iterator[Any]:
    """A connection of redis-py's `pool` for the block; dropped (disconnected) if the block
    raises, so a half-read reply never reaches the next user."""
    conn = pool.get_connection()
    try:
        yield conn
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def set_command(key: str, parts: Parts, ttl: int | None) -> Iterator[Buffer]:
    """The RESP of ``SET key value [EX ttl]`` as pieces to send in order, the value being the
    concatenation of `parts` (not copied)."""
    k = key.encode()
    options = [b"EX", str(ttl).encode()] if ttl is not None else []
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(options), len(k), k, nbytes_of(parts))
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(o), o) for o in options)
    return chain((head,), parts, (tail,))


class RedisClientConnector(RemoteConnector):
    """Operations over any redis-py client in `self.client`."""

    client: Any

    def __init__(self, url: RemoteURL) -> None:
        self.ttl = math.ceil(url.float_option("ttl", 1.0)) if "ttl" in url.options else None

    def get(self, key: str) -> Buffer | None:
        return self.client.get(key)

    def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        return list(self.client.mget(keys)) if keys else []

    def put(self, key: str, parts: Parts) -> None:
        """SET, its value sent from `parts` as they are. redis-py joins the parts and packs the
        command into new buffers first (copies of the whole value: 2.6-3.9x the client's CPU time of
        a 6 MB SET, `benchmarks/valkey_set.py`), so on a client with one connection pool (standalone,
        sentinel) the command is packed here; a cluster client routes by key and packs its own."""
        pool = getattr(self.client, "connection_pool", None)
        if pool is None:
            value = parts[0] if isinstance(parts, Sequence) and len(parts) == 1 else b"".join(parts)
            self.client.set(key, value, ex=self.ttl)
            return
        with borrowed(pool) as conn:
            conn.send_packed_command(set_command(key, parts, self.ttl))
            reply = conn.read_response()  # an error reply raises
        if reply not in (b"OK", "OK", True):
            raise ResponseError(f"SET {key!r} answered {reply!r}")

    def exists(self, key: str) -> bool:
        return bool(self.client.exists(key))

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def delete(self, key: str) -> bool:
        return bool(self.client.delete(key))

    def close(self) -> None:
        self.client.close()


class RedisConnector(RedisClientConnector):
    def __init__(self, url: RemoteURL, timeout: float) -> None:
        url.check_options(REDIS_OPTIONS | (TLS_OPTIONS if url.scheme in TLS_SCHEMES else frozenset()))
        if len(url.hosts) != 1 or len(url.path) > 1:
            raise ValueError(f"remote_url {url.url!r}: {url.scheme}:// takes one host:port "
                             "and an optional /DB")
        super().__init__(url)
        host, port = url.hosts[0]
        max_connections = int(url.float_option("max_connections", 16))
        kwargs = client_kwargs(url, timeout)
        if kwargs.pop("ssl", False):
            kwargs["connection_class"] = redis.SSLConnection
        pool = redis.ConnectionPool(host=host, port=port, db=db_number(url, 0),
                                    max_connections=max_connections, **kwargs)
        self.client = redis.Redis(connection_pool=pool)

    def get_into(self, key: str, read: Callable[[ReadStream, int], T]) -> T | None:
        return self.get_many_into([key], lambda _, stream, length: read(stream, length))[0]

    def get_many_into(self, keys: Sequence[str], read: Callable[[int, ReadStream, int], T]) -> list[T | None]:
        """Pipelined GETs whose values go from the socket straight into `read` (no `bytes` in
        between), on a connection borrowed from redis-py's pool; any error drops the
        connection."""
        if not keys:
            return []
        with borrowed(self.client.connection_pool) as conn:
            sock = getattr(conn, "_sock", None)
            if sock is not None and str(conn.get_protocol() or 2) in ("2", "3"):  # a RESP socket we know
                return self._read_replies(conn, sock, keys, read)
        return super().get_many_into(keys, read)

    @staticmethod
    def _read_replies(conn: Any, sock: Any, keys: Sequence[str],
                      read: Callable[[int, ReadStream, int], T]) -> list[T | None]:
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
        reply = RespBulkReply(sock)
        out: list[T | None] = []
        for i in range(len(keys)):
            length = reply.header()
            if length is None:
                out.append(None)
                continue
            out.append(read(i, reply, length))
            reply.skip_rest()
            reply.finish()
        reply.check_drained()
        return out

    def close(self) -> None:
        self.client.close()
        self.client.connection_pool.disconnect()
