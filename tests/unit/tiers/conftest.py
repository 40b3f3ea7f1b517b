"""Fixtures for the tier unit tests: small KV metadata, an arena allocator, keys and objects."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import MemoryFormat, MemoryObj, MixedMemoryAllocator

LAYERS, HEADS, HEAD, CHUNK = 2, 2, 4, 8
SHAPE = torch.Size([2, LAYERS, CHUNK, HEADS * HEAD])


@pytest.fixture
def meta() -> LMCacheEngineMetadata:
    return LMCacheEngineMetadata("test-model", 1, 0, "vllm", torch.bfloat16, (LAYERS, 2, CHUNK, HEADS, HEAD))


@pytest.fixture
def allocator() -> MixedMemoryAllocator:
    return MixedMemoryAllocator(1 << 20)


@pytest.fixture
def key() -> Callable[[int], CacheEngineKey]:
    return lambda i: CacheEngineKey("kv_blob", "test-model", 1, 0, f"{i:032x}", "bfloat16")


@pytest.fixture
def make_obj(allocator: MixedMemoryAllocator) -> Callable[[int], MemoryObj]:
    """A KV_BLOB object of SHAPE filled with data determined by `seed` (ref count 1)."""

    def make(seed: int) -> MemoryObj:
        obj = allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_BLOB)
        assert obj is not None
        obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        return obj

    return make


@pytest.fixture
def disk_config(tmp_path) -> Callable[..., LMCacheEngineConfig]:
    """`disk_config(size_bytes=1 MiB, **fields)`: a config with the disk tier in tmp_path/disk."""

    def make(size_bytes: int = 1 << 20, **kw) -> LMCacheEngineConfig:
        return LMCacheEngineConfig.from_defaults(local_disk=str(tmp_path / "disk"),
                                                 max_local_disk_size=size_bytes / (1 << 30), **kw)

    return make
