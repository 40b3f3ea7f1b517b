"""Seed path alias of `lmcache.cache_key` (part of the compat edge)."""

from lmcache.cache_key import CacheEngineKey, dtype_tag

__all__ = ["CacheEngineKey", "dtype_tag"]
