"""Remote stores behind `RemoteConnector`, picked by URL scheme (see `url.py` for the forms)."""

from __future__ import annotations

import importlib

from lmcache.storage_backend.connectors.base import RemoteConnector
from lmcache.storage_backend.connectors.url import RemoteURL, parse_remote_url, redact_url

# scheme -> "module:Class", imported on first use (redis-py is only needed for the redis family)
_REGISTRY = {
    "lm": "lm_connector:LMConnector",
    "redis": "redis_connector:RedisConnector",
    "rediss": "redis_connector:RedisConnector",
    "valkey": "redis_connector:RedisConnector",
    "valkeys": "redis_connector:RedisConnector",
    "redis-sentinel": "sentinel_connector:SentinelConnector",
    "redis-cluster": "cluster_connector:ClusterConnector",
}


def remote_schemes() -> list[str]:
    return list(_REGISTRY)


def create_connector(url: RemoteURL | str, timeout: float) -> RemoteConnector:
    """A connector for `url`; raises ValueError for an unknown scheme or bad options. Does not
    contact the store (an unreachable store shows up as failing calls, i.e. misses)."""
    parsed = parse_remote_url(url) if isinstance(url, str) else url
    ref = _REGISTRY.get(parsed.scheme)
    if ref is None:
        raise ValueError(f"remote_url {parsed.url!r}: unknown scheme {parsed.scheme!r}; "
                         f"choose one of {sorted(_REGISTRY)}")
    module_name, cls_name = ref.split(":")
    cls = getattr(importlib.import_module(f"{__name__}.{module_name}"), cls_name)
    return cls(parsed, timeout)


__all__ = ["RemoteConnector", "RemoteURL", "create_connector", "parse_remote_url", "redact_url",
           "remote_schemes"]
