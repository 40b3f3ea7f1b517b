"""The tier registry: every storage tier class, by name, in lookup order.

A tier module registers its class with `@register_tier`; `tier_classes()` imports the built-in
tier modules once and returns the classes sorted by `lookup_order`. Everything that needs tier
names (the config's checks, `search_range`, the storage manager) derives them from here.
"""

from __future__ import annotations

import importlib
from typing import TypeVar

from lmcache.storage_backend.abstract_backend import StorageBackendInterface, TierContext

T = TypeVar("T", bound=type[StorageBackendInterface])

_BUILTIN_MODULES = ("local_cpu_backend", "cache_server_backend", "pd_backend", "local_disk_backend",
                    "remote_backend", "peer_backend")
_TIERS: dict[str, type[StorageBackendInterface]] = {}


def register_tier(cls: T) -> T:
    """Add a tier class; ValueError if its name or an alias is another class's name or alias."""
    taken = {n: other for other in _TIERS.values() if other is not cls
             for n in (other.name, *other.aliases)}
    for name in (cls.name, *cls.aliases):
        if name in taken:
            raise ValueError(f"tier name {name!r} is taken by {taken[name].__name__}")
    _TIERS[cls.name] = cls
    return cls


def tier_classes() -> list[type[StorageBackendInterface]]:
    for module in _BUILTIN_MODULES:
        importlib.import_module(f"lmcache.storage_backend.{module}")
    return sorted(_TIERS.values(), key=lambda cls: cls.lookup_order)


def tier_names() -> dict[str, str]:
    """Every name a tier answers to (its `name` and its `aliases`) -> its `name`."""
    return {n: cls.name for cls in tier_classes() for n in (cls.name, *cls.aliases)}


def create_tiers(ctx: TierContext) -> list[StorageBackendInterface]:
    """The tiers `ctx.config` enables, in lookup order. Lower tiers never contact their store
    here: an unreachable remote shows up as misses later."""
    tiers: list[StorageBackendInterface] = []
    try:
        for cls in tier_classes():
            tier = cls.create(ctx)
            if tier is not None:
                tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers
