"""Serializers for the disk and remote tiers, chosen by name (`remote_serde`).

`create_serde(name, config, metadata)` returns a (Serializer, Deserializer) pair. Every blob
carries the header of `blob.py` (magic, version, shape, dtype, length, checksum).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.storage_backend.serde.registry import serde_classes, serde_names
from lmcache.storage_backend.serde.serde import (
    CorruptBlobError,
    Deserializer,
    DeserializerDebugWrapper,
    ForeignSerdeError,
    Serializer,
    SerializerDebugWrapper,
)

if TYPE_CHECKING:  # the config imports only the registry (the names), not this module
    from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata

def create_serde(name: str, config: LMCacheEngineConfig,
                 metadata: LMCacheEngineMetadata) -> tuple[Serializer, Deserializer]:
    ser_cls, deser_cls = serde_classes(name)
    if name == "cachegen":
        return ser_cls(config, metadata), deser_cls(config, metadata, metadata.kv_dtype)
    return ser_cls(), deser_cls(metadata.kv_dtype)


__all__ = [
    "CorruptBlobError", "Deserializer", "ForeignSerdeError", "DeserializerDebugWrapper", "Serializer",
    "SerializerDebugWrapper", "create_serde", "serde_names",
]
