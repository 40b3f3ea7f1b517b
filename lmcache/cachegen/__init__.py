"""CacheGen: a codec that compresses KV caches (per-layer quantization + entropy coding)."""
