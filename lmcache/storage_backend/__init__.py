"""Storage tiers behind one interface (`abstract_backend`), registered by class (`registry`) and
combined by `storage_manager`.

`create_storage_backends` builds the tiers a config enables, in lookup order: "Hot"
(`LocalCPUBackend`), "PDBackend" (KV a prefill instance sent this decode instance: `lmcache.pd`),
"LocalDiskBackend", "RemoteBackend", "PeerBackend" (other instances' local tiers, found through
the peer lookup service). Their faults are misses (`lmcache.failures`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.memory_management import MemoryAllocatorInterface
from lmcache.storage_backend.abstract_backend import StorageBackendInterface, TierContext
from lmcache.storage_backend.leases import PinTable
from lmcache.storage_backend.registry import create_tiers, register_tier, tier_classes, tier_names
from lmcache.storage_backend.serde.serde import AllocateFn

if TYPE_CHECKING:  # the config names plug-ins from this package's registries
    from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata


def create_storage_backends(
    config: LMCacheEngineConfig,
    metadata: LMCacheEngineMetadata,
    allocator: MemoryAllocatorInterface,
    allocate: AllocateFn,
    pins: PinTable | None = None,
) -> dict[str, StorageBackendInterface]:
    """The tiers `config` enables, by name, in lookup order. `allocate(shape, dtype, fmt)` gives
    lower tiers buffers (evicting from the hot tier)."""
    ctx = TierContext(config, metadata, allocator, allocate, pins if pins is not None else PinTable())
    return {tier.name: tier for tier in create_tiers(ctx)}


__all__ = [
    "StorageBackendInterface", "TierContext", "create_storage_backends", "create_tiers",
    "register_tier", "tier_classes", "tier_names",
]
