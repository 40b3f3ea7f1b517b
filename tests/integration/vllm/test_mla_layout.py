"""MLA latents: the layout check against vLLM's own CPU MLA cache write, and the "mla" paged copy."""

import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.integration.vllm.mla_layout import check_latent_rows
from lmcache.memory_management import HostMemoryAllocator, MemoryFormat

RANK, ROPE, BS, NB, L = 512, 64, 16, 8, 3


def cpu_mla_impl():
    """vLLM's CPU MLA cache write (it reads nothing of the implementation's state)."""
    return SimpleNamespace(kv_lora_rank=RANK,
                           do_kv_cache_update=functools.partial(CPUMLAImpl.do_kv_cache_update, None))


def bound_layer(impl, block_size=BS):
    """An MLA layer as vLLM binds it: the registered [blocks, 1, block_size, latent] cache squeezed."""
    return SimpleNamespace(impl=impl, kv_cache=torch.zeros(NB, 1, block_size, RANK + ROPE,
                                                           dtype=torch.bfloat16).squeeze(1))


def write(impl, cache, latents, slots):
    impl.do_kv_cache_update(latents[:, :RANK].contiguous(), latents[:, RANK:].unsqueeze(1).contiguous(),
                            cache, slots, "auto", torch.ones(1))


def test_vllms_cpu_mla_write_keeps_latents_as_token_rows():
    check_latent_rows(bound_layer(cpu_mla_impl()), BS)


def test_vllms_amx_mla_write_keeps_latents_as_token_rows():
    """The AMX MLA backend (vLLM's choice for MLA wherever the CPU has AMX) writes through a kernel
    that takes only the layer's 3-D view of the cache."""
    from vllm.platforms import current_platform

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's AMX MLA backend runs only on a CPU with AMX")
    current_platform.import_kernels()
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

    impl = SimpleNamespace(kv_lora_rank=RANK,
                           do_kv_cache_update=functools.partial(AMXMLAImpl.do_kv_cache_update, None))
    check_latent_rows(bound_layer(impl, block_size=128), 128)


def test_a_write_op_that_fails_on_the_probe_is_a_refusal_not_a_crash():
    def four_d_only(kv_c, k_pe, kv_cache, *args):
        if kv_cache.dim() != 4:
            raise RuntimeError("kv_cache must be 4D")

    impl = SimpleNamespace(kv_lora_rank=RANK, do_kv_cache_update=four_d_only)
    with pytest.raises(ValueError, match=r"cache write failed on a .* probe cache: kv_cache must be 4D"):
        check_latent_rows(bound_layer(impl), BS)


def test_a_write_that_does_not_keep_token_rows_is_refused():
    def tiled(kv_c, k_pe, kv_cache, slot_mapping, *args):  # latents stored dim-major inside a block
        latents = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)
        blocks = kv_cache.view(-1, BS, RANK + ROPE)
        for t, s in enumerate(slot_mapping.tolist()):
            blocks[s // BS].view(RANK + ROPE, BS)[:, s % BS] = latents[t]

    impl = SimpleNamespace(kv_lora_rank=RANK, do_kv_cache_update=tiled)
    with pytest.raises(ValueError, match="does not keep MLA latents as token rows"):
        check_latent_rows(bound_layer(impl), BS)


@pytest.mark.parametrize("use_native", [True, False])
def test_latents_round_trip_through_one_object_row_per_layer(use_native):
    impl = cpu_mla_impl()
    n = 40
    slots = torch.randperm(NB * BS)[:n]
    caches = [torch.zeros(NB, 1, BS, RANK + ROPE, dtype=torch.bfloat16) for _ in range(L)]
    latents = [torch.randn(n, RANK + ROPE).to(torch.bfloat16) for _ in range(L)]
    for cache, lat in zip(caches, latents):
        write(impl, cache, lat, slots)
    conn = VLLMPagedMemGPUConnectorV2(RANK + ROPE, L, layout="mla", use_native=use_native)
    assert tuple(conn.get_shape(n)) == (1, L, n, RANK + ROPE)  # no K/V split, no padding
    obj = HostMemoryAllocator(1 << 22).allocate(conn.get_shape(n), torch.bfloat16, MemoryFormat.KV_BLOB)
    conn.from_gpu(obj, 0, n, kvcaches=caches, slot_mapping=slots)
    for layer, lat in enumerate(latents):
        assert torch.equal(obj.tensor[0, layer], lat)
    fresh = [torch.zeros_like(c) for c in caches]
    conn.to_gpu(obj, 0, n, kvcaches=fresh, slot_mapping=slots)
    for a, b in zip(caches, fresh):
        assert torch.equal(a, b)
