"""The serde registry: serde names (`remote_serde`, `local_disk_serde`) -> their classes, imported on
first use. A leaf module (the config validates names against it); `create_serde` builds a pair."""

from __future__ import annotations

import importlib

# name -> ("module:SerializerClass", "module:DeserializerClass"), imported on first use; a module
# starting with "." is one of this package's
_REGISTRY = {
    "naive": (".naive_serde:NaiveSerializer", ".naive_serde:NaiveDeserializer"),
    "torch": (".torch_serde:TorchSerializer", ".torch_serde:TorchDeserializer"),
    "safe": (".safe_serde:SafeSerializer", ".safe_serde:SafeDeserializer"),
    "fast": (".fast_serde:FastSerializer", ".fast_serde:FastDeserializer"),
    "cachegen": ("lmcache.cachegen.serde:CacheGenSerializer", "lmcache.cachegen.serde:CacheGenDeserializer"),
}


def serde_names() -> list[str]:
    return list(_REGISTRY)


def serde_classes(name: str) -> tuple[type, type]:
    """The (Serializer, Deserializer) classes of serde `name` (imported now); ValueError for an
    unknown name."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown serde {name!r}; choose one of {sorted(_REGISTRY)}")
    ser, deser = (_load(ref) for ref in _REGISTRY[name])
    return ser, deser


def _load(ref: str) -> type:
    module_name, cls_name = ref.split(":")
    return getattr(importlib.import_module(module_name, __package__), cls_name)
