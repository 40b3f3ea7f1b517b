"""Storage tiers behind one interface (`abstract_backend`), registered by class (`registry`) and
combined by `storage_manager`.

`create_storage_backends` builds the tiers a config enables, in lookup order: "Hot"
(`LocalCPUBackend`), "PDBackend" (KV a prefill instance sent this decode instance: `lmcache.pd`),
"LocalDiskBackend", "RemoteBackend", "PeerBackend" (other instances' local tiers, found through
the peer lookup service). Their faults are misses (`lmcache.failures`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config names plug-ins from this package's registries
    from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
    from lmcache.memory_management import MemoryAllocatorInterface
    from lmcache.storage_backend.abstract_backend import StorageBackendInterface as StorageBackendInterface
    from lmcache.storage_backend.abstract_backend import TierContext as TierContext
    from lmcache.storage_backend.leases import PinTable
    from lmcache.storage_backend.registry import create_tiers as create_tiers
    from lmcache.storage_backend.registry import register_tier as register_tier
    from lmcache.storage_backend.registry import tier_classes as tier_classes
    from lmcache.storage_backend.registry import tier_names as tier_names
    from lmcache.storage_backend.serde.serde import AllocateFn

# What the package exports from its modules, by module: imported on first use, so that importing a
# light module of the package (`events`, which `lmcache router` and `lmcache proxy` reach through
# `lmcache.kv_events`) does not import torch with the tiers (1.1 s of the router's 1.4 s import).
_LAZY = {"StorageBackendInterface": "abstract_backend", "TierContext": "abstract_backend",
         "create_tiers": "registry", "register_tier": "registry", "tier_classes": "registry",
         "tier_names": "registry"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def create_storage_backends(
    config: LMCacheEngineConfig,
    metadata: LMCacheEngineMetadata,
    allocator: MemoryAllocatorInterface,
    allocate: AllocateFn,
    pins: PinTable | None = None,
) -> dict[str, StorageBackendInterface]:
    """The tiers `config` enables, by name, in lookup order. `allocate(shape, dtype, fmt)` gives
    lower tiers buffers (evicting from the hot tier)."""
    from lmcache.storage_backend.abstract_backend import TierContext
    from lmcache.storage_backend.leases import PinTable
    from lmcache.storage_backend.registry import create_tiers

    ctx = TierContext(config, metadata, allocator, allocate, pins if pins is not None else PinTable())
    return {tier.name: tier for tier in create_tiers(ctx)}


__all__ = ["create_storage_backends", *_LAZY]
