"""Processes for the multi-process disk tests (run as a script with PYTHONPATH = repository root).

    disk_worker.py write DIR FIRST COUNT         store chunks FIRST.. (fixed content per id), exit
    disk_worker.py write-forever DIR COUNT       store chunks 0..COUNT-1 over and over until killed
    disk_worker.py engine-store DIR SEED TOKENS  store SEED's paged KV of TOKENS tokens via an engine
Chunk ids map to keys and contents with `chunk_key` / `chunk_data`, so any process can check any
chunk it reads (`read_all`)."""

from __future__ import annotations

import sys

import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import MemoryFormat, MixedMemoryAllocator
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend

SHAPE = torch.Size([2, 30, 256, 192])  # a SmolLM2 chunk, 5.9 MB: writes take long enough to be cut
META = LMCacheEngineMetadata("SmolLM2", 1, 0, "vllm", torch.bfloat16, (30, 2, 256, 3, 64))
_BASE = (torch.arange(SHAPE.numel()) % 200).to(torch.bfloat16).view(SHAPE)


def chunk_key(i: int) -> CacheEngineKey:
    return CacheEngineKey("kv_blob", "SmolLM2", 1, 0, f"{i:032x}", "bfloat16")


def chunk_data(i: int) -> torch.Tensor:
    return _BASE + (i % 50)


def disk(path: str, alloc: MixedMemoryAllocator) -> LocalDiskBackend:
    config = LMCacheEngineConfig.from_defaults(local_disk=path, max_local_disk_size=1.0)
    return LocalDiskBackend(config, META, alloc.allocate)


def write(path: str, ids: range, forever: bool = False) -> None:
    """Writes run on this thread (`async_save_bytes_to_disk` is the put workers' write)."""
    alloc = MixedMemoryAllocator(2 * SHAPE.numel() * 2)
    d = disk(path, alloc)
    obj = alloc.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_BLOB)
    assert obj is not None
    while True:
        for i in ids:
            obj.tensor.copy_(chunk_data(i))
            d.async_save_bytes_to_disk(chunk_key(i), obj)
            if forever and i == ids[0]:
                print("writing", flush=True)
        if not forever:
            break
    d.close()
    print("done", flush=True)


def read_all(d: LocalDiskBackend, count: int) -> tuple[int, int]:
    """(hits, hits with wrong content) over chunks 0..count-1."""
    hits = wrong = 0
    for i in range(count):
        obj = d.get_blocking(chunk_key(i))
        if obj is not None:
            hits += 1
            wrong += not torch.equal(obj.tensor, chunk_data(i))
            obj.ref_count_down()
    return hits, wrong


def engine_store(path: str, seed: int, tokens: int) -> None:
    from tests.helpers.paged_kv import PagedKV, build_engine

    torch.manual_seed(seed)
    kv = PagedKV()
    ids = torch.randint(0, 30000, (tokens,))
    engine = build_engine(local_disk=path, max_local_disk_size=0.01)
    engine.store(ids, kvcaches=kv.layers, slot_mapping=kv.slots_for(tokens))
    engine.close()  # flushes the disk writes
    print("done", flush=True)


if __name__ == "__main__":
    mode, path, *rest = sys.argv[1:]
    if mode == "write":
        write(path, range(int(rest[0]), int(rest[0]) + int(rest[1])))
    elif mode == "write-forever":
        write(path, range(int(rest[0])), forever=True)
    elif mode == "engine-store":
        engine_store(path, int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
