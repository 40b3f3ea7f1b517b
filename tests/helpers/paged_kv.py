"""Test helpers: small engine KV caches in every connector layout, and a ready engine over one."""

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import TokenMajorConnector, VLLMPagedMemGPUConnectorV2
from lmcache.memory_management import MixedMemoryAllocator
from lmcache.token_database import ChunkedTokenDatabase

PAGED = ("flash_attn", "flashinfer", "kv_tuples")
TOKEN_MAJOR = ("token_major_2d", "token_major_3d", "hf")
LAYOUTS = PAGED + TOKEN_MAJOR


class KVCache:
    """A small cache in one of `LAYOUTS` (random values, or zeros), its connector, and reference
    reads of token rows.

    Paged: per layer [2, nb, bs, H, D] (flash_attn), [nb, 2, bs, H, D] (flashinfer) or (K, V) of
    [nb, bs, H, D] (kv_tuples); slot = block * bs + offset. Token-major (slot = token position):
    per layer (K, V) of [T, H*D], [T, H, D] or HF's [1, H, T, D]."""

    def __init__(self, layout, layers=3, heads=2, head_size=8, block_size=4, num_blocks=32,
                 dtype=torch.bfloat16, device="cpu", zeros=False):
        self.layout, self.heads, self.head_size = layout, heads, head_size
        self.block_size, self.num_blocks, self.dtype, self.device = block_size, num_blocks, dtype, device
        self.hidden = heads * head_size
        self.num_layers = layers
        self.paged = layout in PAGED
        self.num_slots = num_blocks * block_size
        self._next_block = 0
        self._block_order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
        self.kvcaches = [self._layer(zeros) for _ in range(layers)]

    def _tensor(self, shape, zeros):
        if zeros:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        return torch.randn(shape, device=self.device).to(self.dtype)

    def _layer(self, zeros):
        nb, bs, h, d, t = self.num_blocks, self.block_size, self.heads, self.head_size, self.num_slots
        shapes = {"flash_attn": (2, nb, bs, h, d), "flashinfer": (nb, 2, bs, h, d)}
        if self.layout in shapes:
            return self._tensor(shapes[self.layout], zeros)
        pair = {"kv_tuples": (nb, bs, h, d), "token_major_2d": (t, h * d), "token_major_3d": (t, h, d),
                "hf": (1, h, t, d)}[self.layout]
        return (self._tensor(pair, zeros), self._tensor(pair, zeros))

    def kv(self, layer):
        """(K, V) of one layer as they are stored (views)."""
        x = self.kvcaches[layer]
        if self.layout == "flash_attn":
            return x[0], x[1]
        if self.layout == "flashinfer":
            return x[:, 0], x[:, 1]
        return x

    def token_rows(self, t):
        """[num_slots, hidden] copy of one K or V tensor, row = slot."""
        if self.layout == "hf":
            t = t[0].transpose(0, 1)
        return t.reshape(self.num_slots, self.hidden)

    def rows(self, slots):
        """[2, L, n, hidden] of the given slots (CPU)."""
        slots = slots.to(self.device)
        return torch.stack([torch.stack([self.token_rows(self.kv(layer)[i])[slots] for layer in
                                         range(self.num_layers)]) for i in (0, 1)]).cpu()

    def all_rows(self):
        return self.rows(torch.arange(self.num_slots))

    def slots_for(self, n):
        """Slots of n tokens: whole blocks at scattered places, not handed out before (paged);
        positions 0..n-1 (token-major)."""
        if not self.paged:
            return torch.arange(n)
        nblocks = -(-n // self.block_size)
        picks = (torch.arange(nblocks) + self._next_block) % self.num_blocks
        self._next_block += nblocks
        return self._slots_of(self._block_order[picks], n)

    def _slots_of(self, blocks, n):
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()[:n]

    def zeros_like(self):
        return KVCache(self.layout, self.num_layers, self.heads, self.head_size, self.block_size,
                       self.num_blocks, self.dtype, self.device, zeros=True)

    def connector(self, **options):
        if self.paged:
            return VLLMPagedMemGPUConnectorV2(self.hidden, self.num_layers, **options)
        return TokenMajorConnector(self.hidden, self.num_layers, **options)

    def kwargs(self, slots):
        """The connector kwargs for a sequence whose tokens sit at `slots`."""
        if self.paged:
            return {"kvcaches": self.kvcaches, "slot_mapping": slots}
        return {"kvcaches": self.kvcaches}


class PagedKV(KVCache):
    """A vLLM-v1-style paged cache: per layer [2, num_blocks, block_size, heads, head_size]."""

    def __init__(self, layers=2, heads=2, head_size=4, block_size=4, num_blocks=64, dtype=torch.bfloat16):
        super().__init__("flash_attn", layers, heads, head_size, block_size, num_blocks, dtype)
        self.layers = self.kvcaches

    def slots_for(self, n):
        """Slots of n tokens in freshly 'allocated' consecutive blocks (block-aligned; never block
        0, which vLLM keeps as its null block)."""
        nblocks = -(-n // self.block_size)
        blocks = (torch.arange(nblocks) + self._next_block) % (self.num_blocks - 1) + 1
        self._next_block += nblocks
        return self._slots_of(blocks, n)

    def tokens_kv(self, slots):
        """[2, L, n, hidden] of the given slots."""
        return self.rows(slots)

    def empty_like(self):
        other = PagedKV.__new__(PagedKV)
        other.__dict__.update(self.__dict__)
        other.layers = other.kvcaches = [torch.zeros_like(t) for t in self.layers]
        return other


def build_engine(chunk_size=8, layers=2, heads=2, head_size=4, dtype=torch.bfloat16,
                 cpu_bytes=1 << 20, connector=None, state_layout="", kv_count=2, **cfg):
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk_size,
                                               max_local_cpu_size=cpu_bytes / (1 << 30), **cfg)
    shape = (layers, kv_count, chunk_size, heads, head_size)
    metadata = LMCacheEngineMetadata("test-model", 1, 0, "vllm", dtype, shape, state_layout=state_layout)
    connector = connector or VLLMPagedMemGPUConnectorV2(heads * head_size, layers)
    return LMCacheEngine(config, metadata, MixedMemoryAllocator(cpu_bytes),
                         ChunkedTokenDatabase(config, metadata), connector)


def chunk_objects(conn, sizes, gaps=False, allocator=None):
    """Chunk objects for `sizes` tokens each, allocated one after another from one arena (pinned
    where CUDA exists by default), with a small object between them if `gaps` (not adjacent)."""
    from lmcache.memory_management import MemoryFormat, MixedMemoryAllocator

    nbytes = sum(conn.get_shape(n).numel() * 2 for n in sizes)
    alloc = allocator or MixedMemoryAllocator(nbytes + (1 << 20) * len(sizes))
    objs = []
    for n in sizes:
        objs.append(alloc.allocate(conn.get_shape(n), torch.bfloat16, MemoryFormat.KV_BLOB))
        if gaps:
            alloc.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    return objs


def request_ranges(sizes):
    """(starts, ends) of consecutive chunks of `sizes` tokens."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return starts, [s + n for s, n in zip(starts, sizes, strict=True)]
