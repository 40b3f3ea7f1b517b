"""Storage tiers behind one interface (`abstract_backend`), combined by `storage_manager`.

`create_storage_backends` builds the configured tiers in lookup order: "Hot" (`LocalCPUBackend`),
"LocalDiskBackend", "RemoteBackend".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import MemoryAllocatorInterface
from lmcache.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.storage_backend.remote_backend import RemoteBackend

# the tier classes, in lookup order
TIER_CLASSES: tuple[type[StorageBackendInterface], ...] = (LocalCPUBackend, LocalDiskBackend, RemoteBackend)


def create_storage_backends(
    config: LMCacheEngineConfig,
    metadata: LMCacheEngineMetadata,
    allocator: MemoryAllocatorInterface,
    allocate: Callable[..., Any],
) -> dict[str, StorageBackendInterface]:
    """`allocate(shape, dtype, fmt)` gives lower tiers buffers (evicting from the hot tier). Lower
    tiers never contact their store here: an unreachable remote shows up as misses later."""
    backends: dict[str, StorageBackendInterface] = {}
    if config.local_cpu:
        backends["Hot"] = LocalCPUBackend(allocator, config.cache_policy)
    if config.local_disk is not None:
        backends["LocalDiskBackend"] = LocalDiskBackend(config, metadata, allocate)
    if config.remote_url is not None:
        backends["RemoteBackend"] = RemoteBackend(config, metadata, allocate)
    return backends
