"""Compatibility shims for the seed documents' and upstream's APIs: they import the core, the core
never imports them.

- `vllm_adapter`: seed 004's adapter names (`init_lmcache_engine`, `lmcache_store_kv`, ...) over
  the v1 connector's engine set-up and transfers; `lmcache.integration.vllm.vllm_adapter` is its
  seed path.
"""
