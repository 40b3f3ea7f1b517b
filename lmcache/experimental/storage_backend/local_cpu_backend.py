"""Seed path alias of `lmcache.storage_backend.local_cpu_backend` (part of the compat edge)."""

from lmcache.storage_backend.local_cpu_backend import *  # noqa: F403
