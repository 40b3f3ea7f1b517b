"""LMCache for vLLM: the v1 KV connector (`LMCacheConnectorV1`) and the seed's v0-style adapter
names (`vllm_adapter`). Importing this package starts nothing (vLLM imports it in every process)."""

from lmcache.integration.vllm.connector import LMCacheConnectorV1

__all__ = ["LMCacheConnectorV1"]
