"""redis-sentinel://H1:P1,H2:P2/SERVICE[/DB] — the master of SERVICE as Redis Sentinel reports
it (a failover moves the tier to the new master)."""

from __future__ import annotations

from redis.sentinel import Sentinel

from lmcache.storage_backend.connectors.redis_connector import (
    REDIS_OPTIONS,
    RedisClientConnector,
    client_kwargs,
    db_number,
)
from lmcache.storage_backend.connectors.url import RemoteURL


class SentinelConnector(RedisClientConnector):
    def __init__(self, url: RemoteURL, timeout: float) -> None:
        url.check_options(REDIS_OPTIONS)
        if not url.path:
            raise ValueError(f"remote_url {url.url!r}: redis-sentinel:// needs the service name: "
                             "redis-sentinel://h1:p1,h2:p2/SERVICE")
        super().__init__(url)
        kwargs = client_kwargs(url, timeout)
        sentinel_kwargs = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        self.sentinel = Sentinel(url.hosts, sentinel_kwargs=sentinel_kwargs, **kwargs)
        self.client = self.sentinel.master_for(url.path[0], db=db_number(url, 1), **kwargs)
