"""Seed path of `lmcache.storage_backend.local_disk_backend`, part of the compat edge:
`LocalDiskBackend` here is `lmcache.compat.disk_seed.LocalDiskBackend`, the core disk tier plus
seed 000's per-key calls (`insert_key`, `async_load_bytes_from_disk`, `submit_prefetch_task`)."""

from lmcache.compat.disk_seed import LocalDiskBackend

__all__ = ["LocalDiskBackend"]
