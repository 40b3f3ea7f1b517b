"""redis-cluster://H1:P1,H2:P2,... — a Redis/Valkey Cluster through redis-py's `RedisCluster`.

Keys spread over the nodes by hash slot. Each node is its own failure domain, so a dead node only
turns its own share of the keys into misses (run the nodes with `cluster-require-full-coverage
no`, or the surviving nodes refuse all keys while one is down). Batched GETs use
`mget_nonatomic` (grouped by slot). The client learns the topology on first use, not at start-up.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from lmcache.storage_backend.connectors.base import Buffer
from lmcache.storage_backend.connectors.redis_connector import (
    REDIS_OPTIONS,
    RedisClientConnector,
    client_kwargs,
)
from lmcache.storage_backend.connectors.url import RemoteURL


class ClusterConnector(RedisClientConnector):
    def __init__(self, url: RemoteURL, timeout: float) -> None:
        url.check_options(REDIS_OPTIONS)
        if url.path:
            raise ValueError(f"remote_url {url.url!r}: redis-cluster:// takes no path (a cluster has one DB)")
        super().__init__(url)
        self._nodes = [ClusterNode(h, p) for h, p in url.hosts]
        self._kwargs = client_kwargs(url, timeout)
        del self._kwargs["retry"]  # RedisCluster takes its retry policy as its own argument
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = RedisCluster(startup_nodes=self._nodes, require_full_coverage=False,
                                            retry=Retry(NoBackoff(), 1), **self._kwargs)
            return self._client

    def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        return list(self.client.mget_nonatomic(keys)) if keys else []

    def failure_domain(self, key: str) -> str:
        if self._client is None:
            return "*"
        try:
            node = self._client.get_node_from_key(key)
        except Exception:  # noqa: BLE001 - no usable topology: the whole cluster is the domain
            return "*"
        return node.name if node is not None else "*"

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
