"""lm://HOST:PORT — the lmcache server (`lmcache server`), through `LMCacheClient`.

The auth token comes from the `auth_token` URL option or the LMCACHE_AUTH_TOKEN variable.
Like every connector it raises on a fault; the remote tier's failure domain backs off.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from lmcache.server.client import LMCacheClient
from lmcache.storage_backend.connectors.base import Buffer, RemoteConnector, T
from lmcache.storage_backend.connectors.url import RemoteURL
from lmcache.storage_backend.serde.blob_stream import ReadStream
from lmcache.write_parts import Parts


class LMConnector(RemoteConnector):
    def __init__(self, url: RemoteURL, timeout: float) -> None:
        url.check_options(frozenset({"auth_token"}))
        if len(url.hosts) != 1 or url.path:
            raise ValueError(f"remote_url {url.url!r}: lm:// takes exactly one host:port and no path")
        host, port = url.hosts[0]
        token = url.options.get("auth_token") or os.environ.get("LMCACHE_AUTH_TOKEN") or None
        self.client = LMCacheClient(host, port, timeout=timeout, auth_token=token)

    def get(self, key: str) -> Buffer | None:
        return self.client.get(key)

    def get_into(self, key: str, read: Callable[[ReadStream, int], T]) -> T | None:
        return self.client.get_into(key, read)

    def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        return list(self.client.get_many(keys))

    def get_many_into(self, keys: Sequence[str], read: Callable[[int, ReadStream, int], T]) -> list[T | None]:
        return self.client.get_many_into(keys, read)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self.client.exists_many(keys)

    def put(self, key: str, parts: Parts) -> None:
        self.client.put(key, parts)

    def exists(self, key: str) -> bool:
        return self.client.exists(key)

    def delete(self, key: str) -> bool:
        return self.client.delete(key)

    def close(self) -> None:
        self.client.close()
