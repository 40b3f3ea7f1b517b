"""Seed 002's and upstream's legacy config names: `from_legacy(backend=..., local_device=...,
max_local_cache_size=...)` and the tables it reads.

The public entry point stays `LMCacheEngineConfig.from_legacy` (seed 000's name): a staticmethod
of the core class that imports this module when first called, so `lmcache.config` never imports
the compat edge at import time. `lmcache.config` also answers for `LEGACY_BACKENDS`,
`LegacyTiers`, `DEFAULT_LEGACY_DISK_GB` and `default_local_disk` the same way (its module
`__getattr__`), where they used to live.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, NamedTuple

from lmcache.config import ENV_PREFIX, LMCacheEngineConfig

logger = logging.getLogger(__name__)

DEFAULT_LEGACY_DISK_GB = 5.0


class LegacyTiers(NamedTuple):
    hot: bool
    disk: bool
    remote: bool


# upstream's `from_legacy(backend=...)` names -> the tiers each one builds
LEGACY_BACKENDS: dict[str, LegacyTiers] = {
    "cpu": LegacyTiers(True, False, False),
    "local_cpu": LegacyTiers(True, False, False),
    "local_disk": LegacyTiers(False, True, False),
    "local_cpu_disk": LegacyTiers(True, True, False),
    "remote": LegacyTiers(False, False, True),
    "local_cpu_remote": LegacyTiers(True, False, True),
    "local_disk_remote": LegacyTiers(False, True, True),
    "local_cpu_disk_remote": LegacyTiers(True, True, True),
}


def default_local_disk() -> str:
    """Where a legacy ``local_disk`` backend keeps its files unless told otherwise:
    ``$XDG_CACHE_HOME/lmcache/disk`` (``~/.cache/lmcache/disk``)."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "lmcache", "disk")


def _is_device(name: str) -> bool:
    return re.fullmatch(r"cpu|cuda(:\d+)?", name) is not None


def from_legacy(
    chunk_size: int = 256,
    backend: str = "cpu",
    remote_url: str | None = None,
    remote_serde: str = "naive",
    save_decode_cache: bool = False,
    enable_blending: bool = False,
    blend_recompute_ratio: float = 0.15,
    blend_min_tokens: int = 256,
    max_local_disk_size: float = 0.0,
    enable_p2p: bool = False,
    lookup_url: str | None = None,
    distributed_url: str | None = None,
    error_handling: bool = False,
    local_device: str | None = None,
    max_local_cache_size: float | None = None,
    local_disk: str | None = None,
) -> LMCacheEngineConfig:
    """Seed 002's and upstream's legacy names. `backend` (or `local_device`) is one of

    - a name from `LEGACY_BACKENDS` (``cpu``, ``local_disk``, ``local_cpu_disk``, ``remote``,
      ``local_cpu_remote``, ``local_disk_remote``, ``local_cpu_disk_remote``): exactly the
      tiers it names. Its disk tier lives in `local_disk` (else ``$LMCACHE_LOCAL_DISK``, else
      `default_local_disk()`), sized `max_local_disk_size` GB (else `DEFAULT_LEGACY_DISK_GB`);
      its remote tier needs `remote_url` (a `remote_url` given to a name without a remote tier
      is ignored, with a warning);
    - a device, ``cuda[:N]`` (or ``cpu`` as `local_device`): the hot tier (sized
      `max_local_cache_size` GB);
    - a disk path, ``file://PATH`` (or a path with a ``/``): the hot tier plus a disk tier there
      (sized `max_local_cache_size` or `max_local_disk_size` GB, else `DEFAULT_LEGACY_DISK_GB`);
    - a remote URL (``lm://``, ``redis://``, ...): the hot tier plus that remote tier.

    With a device, path or URL form, `remote_url` adds a remote tier. Anything else raises
    ValueError listing the valid names (a typo never becomes a directory)."""
    device = local_device if local_device is not None else backend
    form = device if isinstance(device, str) else ""  # not a string: refused below, by its repr
    kw: dict[str, Any] = {"max_local_disk_size": max_local_disk_size}
    named = LEGACY_BACKENDS.get(form) if local_device is None else None
    if named is not None:
        kw["local_cpu"] = named.hot
        if max_local_cache_size is not None:
            kw["max_local_cpu_size"] = max_local_cache_size
        if named.disk:
            env_disk = os.environ.get(ENV_PREFIX + "LOCAL_DISK")
            kw["local_disk"] = local_disk or env_disk or default_local_disk()
            kw["max_local_disk_size"] = max_local_disk_size or DEFAULT_LEGACY_DISK_GB
        if named.remote:
            if remote_url is None:
                raise ValueError(f"backend {device!r} names a remote tier: pass remote_url=")
            kw["remote_url"] = remote_url
        elif remote_url is not None:
            logger.warning("backend %r has no remote tier; remote_url=%r is ignored", device, remote_url)
    elif _is_device(form):
        if max_local_cache_size is not None:
            kw["max_local_cpu_size"] = max_local_cache_size
    elif "://" in form and not form.startswith("file://"):
        kw["remote_url"] = form
    elif form.startswith("file://") or "/" in form:
        kw["local_disk"] = form
        if max_local_cache_size is not None:
            kw["max_local_disk_size"] = max_local_cache_size
        if not kw["max_local_disk_size"]:
            kw["max_local_disk_size"] = DEFAULT_LEGACY_DISK_GB
    else:
        names = "" if local_device is not None else f"one of {sorted(LEGACY_BACKENDS)}, "
        raise ValueError(f"unknown legacy {'local_device' if local_device is not None else 'backend'} "
                         f"{device!r}: use {names}a device ('cpu', 'cuda[:N]'), a disk path "
                         "('file:///path' or a path with a '/') or a remote URL "
                         "('lm://host:port', 'redis://host:port', ...)")
    if named is None and remote_url is not None:
        kw.setdefault("remote_url", remote_url)
    return LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size, remote_serde=remote_serde, save_decode_cache=save_decode_cache,
        enable_blending=enable_blending, blend_recompute_ratio=blend_recompute_ratio,
        blend_min_tokens=blend_min_tokens, enable_p2p=enable_p2p, lookup_url=lookup_url,
        distributed_url=distributed_url, error_handling=error_handling, **kw,
    )
