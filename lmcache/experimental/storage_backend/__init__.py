"""Seed path alias of `lmcache.storage_backend` (part of the compat edge)."""

from lmcache.storage_backend import *  # noqa: F403
from lmcache.storage_backend import create_storage_backends  # noqa: F401
