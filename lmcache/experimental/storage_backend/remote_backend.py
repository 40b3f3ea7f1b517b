"""Seed path alias of `lmcache.storage_backend.remote_backend` (part of the compat edge)."""

from lmcache.storage_backend.remote_backend import *  # noqa: F403
from lmcache.storage_backend.remote_backend import RemoteBackend  # noqa: F401
