"""LMCache for vLLM: the v1 KV connector (`LMCacheConnectorV1`). Importing this package starts
nothing (vLLM imports it in every process) and imports vLLM only when `LMCacheConnectorV1` is first
read (vLLM's connector factory does ``getattr(module, name)``), so the engine-side modules
(`engine_setup`, `kv_groups`, ...) also import where vLLM is absent, e.g. on a CUDA machine without
it. `vllm_adapter` is seed 004's module path for its v0-style adapter names, an alias of
`lmcache.compat.vllm_adapter`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache.integration.vllm.connector import LMCacheConnectorV1

__all__ = ["LMCacheConnectorV1"]


def __getattr__(name: str) -> Any:
    if name == "LMCacheConnectorV1":
        from lmcache.integration.vllm.connector import LMCacheConnectorV1

        return LMCacheConnectorV1
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
