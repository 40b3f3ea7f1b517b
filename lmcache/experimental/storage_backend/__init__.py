"""Seed path alias of `lmcache.storage_backend`."""

from lmcache.storage_backend import *  # noqa: F403
from lmcache.storage_backend import create_storage_backends  # noqa: F401
