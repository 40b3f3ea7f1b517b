"""Compatibility shims for the seed documents' and upstream's APIs: they import the core, the core
never imports them (except `LMCacheEngineConfig.from_legacy` and the legacy tables, which
`lmcache.config` loads from here on first use; `tests/unit/core/test_compat_edge.py` holds the
list).

- `cachegen_seed`: seed 003's CacheGen helpers the codec never calls (`torch_quant*`,
  `do_dequantize`, `encode_function`, `decode_chunk`, `debug_print_device`, ...); the seed paths
  `lmcache.storage_backend.serde.cachegen_*` re-export them.
- `disk_seed`: seed 000's `LocalDiskBackend` (its seed path's class): the core disk tier plus the
  per-key calls the core's batched path does not use (`insert_key`, `async_load_bytes_from_disk`,
  `submit_prefetch_task`).
- `legacy_config`: `from_legacy` (seed 002's and upstream's legacy config names) and its tables;
  `LMCacheEngineConfig.from_legacy` and `lmcache.config.LEGACY_BACKENDS` etc. load it on first use.
- `vllm_adapter`: seed 004's adapter names (`init_lmcache_engine`, `lmcache_store_kv`, ...) over
  the v1 connector's engine set-up and transfers; `lmcache.integration.vllm.vllm_adapter` is its
  seed path.
"""
