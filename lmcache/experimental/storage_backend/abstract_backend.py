"""Seed path alias of `lmcache.storage_backend.abstract_backend`."""

from lmcache.storage_backend.abstract_backend import *  # noqa: F403
