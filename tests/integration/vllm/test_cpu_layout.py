"""The packed vLLM-CPU layout, checked against vLLM's own cache-write kernel."""

import pytest
import torch

pytest.importorskip("vllm._custom_ops")

from lmcache.integration.vllm.cpu_connector import VLLMCPUPackedConnector
from lmcache.integration.vllm.cpu_layout import _write, default_isa, probe_packed_layout
from lmcache.memory_management import HostMemoryAllocator, MemoryFormat
from tests.helpers.kernel_builds import skip_unless_vllm_writes

H, D, L = 3, 64, 2


def written_cache(dtype, bs, nb, slots, isa):
    """Caches written by vLLM's kernel, and the canonical K/V [L, n, H, D] that went in."""
    n = slots.shape[0]
    caches, ks, vs = [], [], []
    for _ in range(L):
        kv = torch.zeros(nb, H, bs, 2 * D, dtype=dtype)
        k, v = torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype)
        _write(kv, k, v, slots, isa)
        caches.append(kv)
        ks.append(k)
        vs.append(v)
    return caches, torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs", [32, 128])
def test_probe_finds_the_vec_layout_on_this_cpu(dtype, bs):
    isa = default_isa(dtype, bs, D)
    layout = probe_packed_layout(H, D, bs, dtype, isa)
    assert layout.is_vec == (isa in ("vec", "vec16"))


@pytest.mark.parametrize(("isa", "use_native"), [("vec", True), ("vec", False), ("amx", True)])
@pytest.mark.parametrize("aligned", [True, False])
def test_connector_round_trips_what_vllm_wrote(isa, use_native, aligned):
    skip_unless_vllm_writes(isa)
    dtype, bs, nb = torch.bfloat16, 32, 12
    layout = probe_packed_layout(H, D, bs, dtype, isa)
    assert layout.is_vec == (isa == "vec")
    n = 64 if aligned else 50
    blocks = torch.randperm(nb)[: -(-n // bs)]
    slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[:n]
    if not aligned:
        slots = torch.randperm(nb * bs)[:n]
    caches, k, v = written_cache(dtype, bs, nb, slots, isa)
    conn = VLLMCPUPackedConnector(H * D, L, layout, use_native=use_native)
    obj = HostMemoryAllocator(1 << 20).allocate(conn.get_shape(n), dtype, MemoryFormat.KV_BLOB)
    conn.from_gpu(obj, 0, n, kvcaches=caches, slot_mapping=slots)
    assert torch.equal(obj.tensor[0], k.view(L, n, H * D))
    assert torch.equal(obj.tensor[1], v.view(L, n, H * D))
    fresh = [torch.zeros_like(c) for c in caches]
    conn.to_gpu(obj, 0, n, kvcaches=fresh, slot_mapping=slots)
    for a, b in zip(caches, fresh):
        assert torch.equal(a, b)  # same packed bytes as vLLM's own kernel wrote


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_native", [True, False])
def test_to_gpu_skips_negative_slots_and_from_gpu_rejects_them(use_native, dtype):
    bs, nb, n = 32, 6, 64
    layout = probe_packed_layout(H, D, bs, dtype, "vec")
    slots = torch.arange(n) + bs  # blocks 1 and 2
    caches, _, _ = written_cache(dtype, bs, nb, slots, "vec")
    conn = VLLMCPUPackedConnector(H * D, L, layout, use_native=use_native)
    obj = HostMemoryAllocator(1 << 20).allocate(conn.get_shape(n), dtype, MemoryFormat.KV_BLOB)
    conn.from_gpu(obj, 0, n, kvcaches=caches, slot_mapping=slots)
    target = [torch.full_like(c, 7.0) for c in caches]
    skipped = slots.clone()
    skipped[:40] = -1  # a run of 8 consecutive slots starts at 40, a partial one at 56
    conn.to_gpu(obj, 0, n, kvcaches=target, slot_mapping=skipped)
    k_views = [layout.token_views(t)[0].reshape(-1, H, D) for t in target]
    for t_k, src in zip(k_views, caches):
        src_k = layout.token_views(src)[0].reshape(-1, H, D)
        assert bool((t_k[slots[:40]] == 7.0).all())
        assert torch.equal(t_k[slots[40:]], src_k[slots[40:]])
    with pytest.raises(ValueError, match="negative"):
        conn.from_gpu(obj, 0, n, kvcaches=caches, slot_mapping=skipped)


def test_connector_rejects_wrong_cache_shapes():
    layout = probe_packed_layout(H, D, 32, torch.float32, "vec")
    conn = VLLMCPUPackedConnector(H * D, L, layout)
    obj = HostMemoryAllocator(1 << 20).allocate(conn.get_shape(4), torch.float32, MemoryFormat.KV_BLOB)
    bad = [torch.zeros(4, H, 16, 2 * D) for _ in range(L)]
    with pytest.raises(ValueError, match="vLLM-CPU cache"):
        conn.from_gpu(obj, 0, 4, kvcaches=bad, slot_mapping=torch.arange(4))
    good = [torch.zeros(4, H, 32, 2 * D) for _ in range(L)]
    with pytest.raises(ValueError, match="beyond"):
        conn.from_gpu(obj, 0, 4, kvcaches=good, slot_mapping=torch.tensor([0, 1, 2, 4 * 32]))
    with pytest.raises(ValueError, match="heads"):
        VLLMCPUPackedConnector(H * D + 1, L, layout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_request_of_several_chunks_moves_in_one_batched_copy_on_every_path(dtype):
    """The native kernel takes all chunks of a request at once; it, the strided-view path and the
    permutation path must agree bit for bit (store, and retrieve with vLLM's -1 prefix skipped)."""
    bs, nb = 32, 16
    sizes, starts = [64, 64, 50], [0, 64, 128]
    ends = [s + n for s, n in zip(starts, sizes)]
    blocks = torch.randperm(nb)[: -(-ends[-1] // bs)]
    slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[: ends[-1]]
    caches, k, v = written_cache(dtype, bs, nb, slots, "vec")
    layout = probe_packed_layout(H, D, bs, dtype, "vec")
    skip = slots.clone()
    skip[:40] = -1
    results = []
    for use_native in (True, False):
        conn = VLLMCPUPackedConnector(H * D, L, layout, use_native=use_native)
        alloc = HostMemoryAllocator(1 << 22)
        objs = [alloc.allocate(conn.get_shape(n), dtype, MemoryFormat.KV_BLOB) for n in sizes]
        conn.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots)
        for obj, a, b in zip(objs, starts, ends):
            assert torch.equal(obj.tensor[0], k[:, a:b].reshape(L, b - a, H * D))
            assert torch.equal(obj.tensor[1], v[:, a:b].reshape(L, b - a, H * D))
        target = [torch.full_like(c, 5.0) for c in caches]
        done = []
        conn.batched_to_gpu(objs, starts, ends, kvcaches=target, slot_mapping=skip, on_done=done.append)
        assert done == [None]
        results.append(target)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    for t, src in zip(results[0], caches):
        t_k, s_k = (layout.token_views(x)[0].reshape(-1, H, D) for x in (t, src))
        assert bool((t_k[slots[:40]] == 5.0).all())
        assert torch.equal(t_k[slots[40:]], s_k[slots[40:]])


@pytest.mark.parametrize(("isa", "use_native"), [("vec", True), ("vec", False), ("amx", False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_of_several_groups_each_follow_their_groups_slots(isa, use_native, dtype):
    """Two KV cache groups (layer 0: a sliding-window group, layer 1: full attention), each with its
    own block table: a store reads each layer at its group's slots and writes zeros for the tokens
    the group does not hold; a load writes only the tokens the group holds."""
    if isa == "amx" and dtype != torch.bfloat16:
        pytest.skip("vLLM's AMX path is bf16 only")
    skip_unless_vllm_writes(isa)
    bs, nb, n = 32, 12, 64
    layout = probe_packed_layout(H, D, bs, dtype, isa)
    full_slots = torch.arange(n) + 4 * bs  # blocks 4, 5
    window_slots = torch.arange(n) + 8 * bs  # blocks 8, 9
    caches = []
    for slots in (window_slots, full_slots):
        kv = torch.zeros(nb, H, bs, 2 * D, dtype=dtype)
        _write(kv, torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype), slots, isa)
        caches.append(kv)
    held = window_slots.clone()
    held[:40] = -1  # the sliding-window group no longer holds the first 40 tokens
    mapping = torch.stack([held, full_slots])
    conn = VLLMCPUPackedConnector(H * D, L, layout, use_native=use_native, layer_groups=[0, 1])
    obj = HostMemoryAllocator(1 << 20).allocate(conn.get_shape(n), dtype, MemoryFormat.KV_BLOB)
    obj.tensor.fill_(9.0)
    conn.from_gpu(obj, 0, n, kvcaches=caches, slot_mapping=mapping)
    reference = VLLMCPUPackedConnector(H * D, 1, layout, use_native=False)
    for layer, slots in ((0, window_slots), (1, full_slots)):
        want = HostMemoryAllocator(1 << 20).allocate(reference.get_shape(n), dtype, MemoryFormat.KV_BLOB)
        reference.from_gpu(want, 0, n, kvcaches=[caches[layer]], slot_mapping=slots)
        got = obj.tensor[:, layer]
        if layer == 0:
            assert bool((got[:, :40] == 0).all())
            assert torch.equal(got[:, 40:], want.tensor[:, 0, 40:])
        else:
            assert torch.equal(got, want.tensor[:, 0])
    obj.tensor[:, 0, :40] = 7.0  # rows of tokens the group does not hold: a load must not write them
    fresh = [torch.zeros_like(c) for c in caches]
    conn.to_gpu(obj, 0, n, kvcaches=fresh, slot_mapping=mapping)
    assert torch.equal(fresh[1], caches[1])
    untouched = [torch.zeros_like(caches[0])]
    reference.to_gpu(obj_layer(obj, 0, dtype, reference, n), 0, n, kvcaches=untouched,
                     slot_mapping=torch.cat([torch.full((40,), -1), window_slots[40:]]))
    assert torch.equal(fresh[0], untouched[0])  # only the held tokens were written
    with pytest.raises(ValueError, match="2 KV cache group"):
        conn.from_gpu(obj, 0, n, kvcaches=caches, slot_mapping=full_slots)


def obj_layer(obj, layer, dtype, conn, n):
    """A one-layer KV_BLOB object holding `layer` of `obj`."""
    one = HostMemoryAllocator(1 << 20).allocate(conn.get_shape(n), dtype, MemoryFormat.KV_BLOB)
    one.tensor.copy_(obj.tensor[:, layer: layer + 1])
    return one


def test_a_kernel_that_packs_otherwise_than_its_isas_closed_form_refuses_the_connector(monkeypatch, caplog):
    """A probed layout that differs from the closed form of vLLM's ISA (K and V exchanged here, as a
    vLLM upgrade might) is never served: the worker logs one refusal and its lookups answer 0."""
    import lmcache.integration.vllm.cpu_layout as cpu_layout
    from lmcache.config import LMCacheEngineConfig
    from lmcache.integration.vllm.cpu_layout import LayoutMismatch, PackedLayout, packed_layout
    from lmcache.integration.vllm.kv_groups import GroupKind, KVGroup, ModelKV
    from lmcache.integration.vllm.worker import LMCacheWorker
    from tests.helpers.vllm_config import instance_config

    bs, dtype = 32, torch.float32
    isa = default_isa(dtype, bs, D)
    real = probe_packed_layout(H, D, bs, dtype, isa)
    swapped = PackedLayout(H, D, bs, isa, real.v_perm, real.k_perm)
    monkeypatch.setattr(cpu_layout, "probe_packed_layout", lambda *args, **kwargs: swapped)
    packed_layout.cache_clear()
    try:
        with pytest.raises(LayoutMismatch, match="otherwise than the vec layout"):
            packed_layout(H, D, bs, dtype)
        model = ModelKV("llama", (KVGroup(0, GroupKind.FULL, bs, ("l.0", "l.1")),), H, D, dtype)
        config = LMCacheEngineConfig.from_defaults(chunk_size=256)
        worker = LMCacheWorker(instance_config(), config, rank=0, kv=model)
        worker.register_kv_caches({n: torch.zeros(4, H, bs, 2 * D, dtype=dtype) for n in ("l.0", "l.1")})
        try:
            assert worker.engine is None
            assert worker._answer({"cmd": "lookup", "lease": "x"}, None) == {"hit": 0}
            refusals = [r.getMessage() for r in caplog.records if "LMCache cannot serve" in r.getMessage()]
            assert len(refusals) == 1 and "otherwise than the vec layout" in refusals[0]
        finally:
            worker.close()
    finally:
        packed_layout.cache_clear()
