"""Seed path alias of `lmcache.storage_backend.storage_manager` (part of the compat edge)."""

from lmcache.storage_backend.storage_manager import *  # noqa: F403
