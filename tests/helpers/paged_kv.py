"""Test helpers: a small vLLM-style paged KV cache and a ready engine over it."""

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.memory_management import MixedMemoryAllocator
from lmcache.token_database import ChunkedTokenDatabase


class PagedKV:
    """A small vLLM-v1-style paged cache: per layer [2, num_blocks, block_size, heads, head_size]."""

    def __init__(self, layers=2, heads=2, head_size=4, block_size=4, num_blocks=64,
                 dtype=torch.bfloat16):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.hidden = heads * head_size
        self.layers = [torch.randn(2, num_blocks, block_size, heads, head_size).to(dtype)
                       for _ in range(layers)]
        self._next = 0

    def slots_for(self, n):
        """Slots of n tokens in freshly 'allocated' blocks (block-aligned)."""
        nblocks = -(-n // self.block_size)
        blocks = (torch.arange(nblocks) + self._next) % self.num_blocks
        self._next += nblocks
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()[:n]

    def tokens_kv(self, slots):
        """[2, L, n, hidden] of the given slots."""
        return torch.stack([torch.stack([t[i].reshape(-1, self.hidden)[slots] for t in self.layers])
                            for i in (0, 1)])

    def empty_like(self):
        other = PagedKV.__new__(PagedKV)
        other.__dict__.update(self.__dict__)
        other.layers = [torch.zeros_like(t) for t in self.layers]
        return other


def build_engine(chunk_size=8, layers=2, heads=2, head_size=4, dtype=torch.bfloat16,
                 cpu_bytes=1 << 20, **cfg):
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk_size,
                                               max_local_cpu_size=cpu_bytes / (1 << 30), **cfg)
    metadata = LMCacheEngineMetadata("test-model", 1, 0, "vllm", dtype,
                                     (layers, 2, chunk_size, heads, head_size))
    connector = VLLMPagedMemGPUConnectorV2(heads * head_size, layers)
    return LMCacheEngine(config, metadata, MixedMemoryAllocator(cpu_bytes),
                         ChunkedTokenDatabase(config, metadata), connector)
