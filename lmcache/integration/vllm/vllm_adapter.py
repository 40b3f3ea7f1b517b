"""Seed 004's module path for its vLLM adapter names: an alias of `lmcache.compat.vllm_adapter`
(part of the compat edge; the v1 connector never imports it)."""

from lmcache.compat.vllm_adapter import (
    RetrieveStatus,
    StoreStatus,
    init_lmcache_engine,
    lmcache_retrieve_kv,
    lmcache_should_retrieve,
    lmcache_should_store,
    lmcache_store_kv,
)

__all__ = [
    "RetrieveStatus", "StoreStatus", "init_lmcache_engine", "lmcache_retrieve_kv", "lmcache_should_retrieve",
    "lmcache_should_store", "lmcache_store_kv",
]
