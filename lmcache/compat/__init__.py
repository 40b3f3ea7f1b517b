"""Compatibility shims for the seed documents' and upstream's APIs: they import the core, the core
never imports them.

- `legacy_config`: `from_legacy` (seed 002's and upstream's legacy config names) and its tables;
  `LMCacheEngineConfig.from_legacy` and `lmcache.config.LEGACY_BACKENDS` etc. load it on first use.
- `vllm_adapter`: seed 004's adapter names (`init_lmcache_engine`, `lmcache_store_kv`, ...) over
  the v1 connector's engine set-up and transfers; `lmcache.integration.vllm.vllm_adapter` is its
  seed path.
"""
