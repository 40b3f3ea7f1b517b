"""Seed path alias of `lmcache.storage_backend.local_cpu_backend`."""

from lmcache.storage_backend.local_cpu_backend import *  # noqa: F403
