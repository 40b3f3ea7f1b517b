"""Seed path alias of `lmcache.storage_backend.local_disk_backend`."""

from lmcache.storage_backend.local_disk_backend import *  # noqa: F403
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401
