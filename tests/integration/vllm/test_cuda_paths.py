"""vLLM's CUDA KV layouts through the engine (runs only where CUDA is present)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

L, H, D, BS, NB = 4, 2, 64, 16, 32


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer"])
def test_vllm_cuda_layouts_round_trip_through_the_engine(layout):
    from lmcache.cache_engine import LMCacheEngine
    from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
    from lmcache.integration.vllm.vllm_adapter import connector_kvcaches, platform_connector
    from lmcache.memory_management import MixedMemoryAllocator
    from lmcache.token_database import ChunkedTokenDatabase

    shape = (2, NB, BS, H, D) if layout == "flash_attn" else (NB, 2, BS, H, D)
    caches = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(L)]
    config = LMCacheEngineConfig.from_defaults(chunk_size=64, max_local_cpu_size=0.05)
    metadata = LMCacheEngineMetadata("m", 1, 0, "vllm", torch.bfloat16, (L, 2, 64, H, D))
    engine = LMCacheEngine(config, metadata, MixedMemoryAllocator(config.max_local_cpu_bytes),
                           ChunkedTokenDatabase(config, metadata),
                           platform_connector("cuda", torch.bfloat16, H, D, BS, L))
    tokens = torch.randint(0, 1000, (150,))
    blocks = torch.randperm(NB)[:10]
    slots = (blocks[:, None] * BS + torch.arange(BS)).flatten()[:150].cuda()
    engine.store(tokens, kvcaches=connector_kvcaches(caches, BS), slot_mapping=slots)
    out = [torch.zeros_like(c) for c in caches]
    assert bool(engine.retrieve(tokens, kvcaches=connector_kvcaches(out, BS), slot_mapping=slots).all())
    for a, b in zip(connector_kvcaches(caches, BS), connector_kvcaches(out, BS)):
        ka, va = (a[0], a[1])
        kb, vb = (b[0], b[1])
        for x, y in ((ka, kb), (va, vb)):
            assert torch.equal(x.reshape(-1, H * D)[slots], y.reshape(-1, H * D)[slots])
    engine.close()
