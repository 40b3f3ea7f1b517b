"""Seed path alias of `lmcache.storage_backend.evictor`."""

from lmcache.storage_backend.evictor import *  # noqa: F403
