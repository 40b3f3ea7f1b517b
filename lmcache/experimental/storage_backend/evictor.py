"""Seed path alias of `lmcache.storage_backend.evictor` (part of the compat edge)."""

from lmcache.storage_backend.evictor import *  # noqa: F403
