"""Seed path alias of `lmcache.cache_engine`."""

from lmcache.cache_engine import *  # noqa: F403
