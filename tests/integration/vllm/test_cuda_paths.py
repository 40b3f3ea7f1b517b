"""vLLM's CUDA KV layouts through the engine as the worker wires them (runs only where CUDA is
present): `vllm_layout` names the layout, `platform_connector` builds the staged connector for it,
a load leaves the tokens vLLM already holds (-1 slots) untouched and never synchronises the host
(the next work on vLLM's stream sees the loaded KV). vLLM itself is not needed: the engine-side
modules import without it, so this runs on a CUDA machine that lacks vLLM."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

L, H, D, BS, NB = 4, 2, 64, 16, 32


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer"])
def test_vllm_cuda_layouts_round_trip_through_the_engine(layout):
    from lmcache.cache_engine import LMCacheEngine
    from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
    from lmcache.integration.vllm.engine_setup import connector_kvcaches, platform_connector, vllm_layout
    from lmcache.memory_management import MixedMemoryAllocator
    from lmcache.token_database import ChunkedTokenDatabase

    shape = (2, NB, BS, H, D) if layout == "flash_attn" else (NB, 2, BS, H, D)
    caches = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(L)]
    assert vllm_layout(caches, BS) == layout
    config = LMCacheEngineConfig.from_defaults(chunk_size=64, max_local_cpu_size=0.05)
    metadata = LMCacheEngineMetadata("m", 1, 0, "vllm", torch.bfloat16, (L, 2, 64, H, D))
    connector = platform_connector("cuda", torch.bfloat16, H, D, BS, L, layout=layout)
    engine = LMCacheEngine(config, metadata, MixedMemoryAllocator(config.max_local_cpu_bytes),
                           ChunkedTokenDatabase(config, metadata), connector)
    tokens = torch.randint(0, 1000, (150,))
    blocks = torch.randperm(NB)[:10]
    slots = (blocks[:, None] * BS + torch.arange(BS)).flatten()[:150]
    engine.store(tokens, kvcaches=connector_kvcaches(caches, BS), slot_mapping=slots)
    assert connector.drain(30)

    def rows(cs):
        kv_axis = 0 if layout == "flash_attn" else 1
        return torch.stack([torch.stack([c.select(kv_axis, i).reshape(-1, H * D) for c in cs])
                            for i in (0, 1)])

    out = [torch.full_like(c, 3.0) for c in caches]
    load = slots.clone()
    load[:16] = -1  # vLLM's own prefix cache holds the first block
    assert bool(engine.retrieve(tokens, kvcaches=connector_kvcaches(out, BS), slot_mapping=load).all())
    got = rows(out)  # on the caller's stream, no host synchronisation before it
    expected = rows(caches)
    assert torch.equal(got[:, :, slots[16:]], expected[:, :, slots[16:]])
    assert bool((got[:, :, slots[:16]] == 3.0).all())
    engine.close()
