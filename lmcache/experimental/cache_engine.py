"""Seed path alias of `lmcache.cache_engine` (part of the compat edge)."""

from lmcache.cache_engine import *  # noqa: F403
