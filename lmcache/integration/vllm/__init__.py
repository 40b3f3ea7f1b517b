"""LMCache for vLLM: the v1 KV connector (`LMCacheConnectorV1`). Importing this package starts
nothing (vLLM imports it in every process). `vllm_adapter` is seed 004's module path for its
v0-style adapter names, an alias of `lmcache.compat.vllm_adapter`."""

from lmcache.integration.vllm.connector import LMCacheConnectorV1

__all__ = ["LMCacheConnectorV1"]
