"""Serializers for the disk and remote tiers, chosen by name (`remote_serde`).

`create_serde(name, config, metadata)` returns a (Serializer, Deserializer) pair. Every blob
carries the header of `blob.py` (magic, version, shape, dtype, length, checksum).
"""

from __future__ import annotations

import importlib

from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.storage_backend.serde.serde import (
    CorruptBlobError,
    Deserializer,
    DeserializerDebugWrapper,
    ForeignSerdeError,
    Serializer,
    SerializerDebugWrapper,
)

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


def _load(ref: str) -> type:
    module_name, cls_name = ref.split(":")
    return getattr(importlib.import_module(module_name, __name__), cls_name)


def create_serde(name: str, config: LMCacheEngineConfig,
                 metadata: LMCacheEngineMetadata) -> tuple[Serializer, Deserializer]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown serde {name!r}; choose one of {sorted(_REGISTRY)}")
    ser_cls, deser_cls = (_load(ref) for ref in _REGISTRY[name])
    if name == "cachegen":
        return ser_cls(config, metadata), deser_cls(config, metadata, metadata.kv_dtype)
    return ser_cls(), deser_cls(metadata.kv_dtype)


__all__ = [
    "CorruptBlobError", "Deserializer", "ForeignSerdeError", "DeserializerDebugWrapper", "Serializer",
    "SerializerDebugWrapper", "create_serde", "serde_names",
]
