"""Seed path alias of `lmcache.storage_backend.storage_manager`."""

from lmcache.storage_backend.storage_manager import *  # noqa: F403
