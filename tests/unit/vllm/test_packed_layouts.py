"""vLLM-CPU's packed KV layouts without the hardware: the closed forms against the permutations
vLLM's kernel produced on an AMX machine (`tests/data/vllm_cpu_layouts`), against the live probe
where the kernel runs, and the copies (native and torch, every direction) against both."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from lmcache.integration.vllm.cpu_connector import VLLMCPUPackedConnector
from lmcache.integration.vllm.cpu_layout import (
    PackedLayout,
    closed_form_layout,
    isa_kind,
    packed_layout,
    probe_packed_layout,
)
from lmcache.memory_management import HostMemoryAllocator, MemoryFormat
from tests.helpers.copy_paths import NATIVE_PATHS, copy_isa
from tests.helpers.kernel_builds import skip_unless_vllm_writes

SAMPLES = Path(__file__).parents[2] / "data" / "vllm_cpu_layouts"
CASES = json.loads((SAMPLES / "index.json").read_text())["cases"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def case_id(case):
    return Path(case["file"]).stem


def measured(case) -> PackedLayout:
    """The layout vLLM's kernel wrote on the AMX machine."""
    data = np.load(SAMPLES / case["file"])
    return PackedLayout(case["num_kv_heads"], case["head_size"], case["block_size"], case["isa"],
                        torch.from_numpy(data["k_perm"].astype(np.int64)).flatten(),
                        torch.from_numpy(data["v_perm"].astype(np.int64)).flatten())


def copies(layout: PackedLayout, layers: int, dtype, caches, slots, skip, bounds, path: str):
    """Gather `bounds` chunks from `caches` and scatter them into caches full of 7s (`skip` slots
    -1 are held by vLLM), natively on vector path `path` and by torch: [(chunk tensors, caches)]
    per way."""
    h, d = layout.num_kv_heads, layout.head_size
    results = []
    for use_native, cap in [(True, path), (False, None)]:
        conn = VLLMCPUPackedConnector(h * d, layers, layout, use_native=use_native)
        alloc = HostMemoryAllocator(1 << 26)
        objs = [alloc.allocate(conn.get_shape(b - a), dtype, MemoryFormat.KV_BLOB) for a, b in bounds]
        starts, ends = [a for a, _ in bounds], [b for _, b in bounds]
        target = [torch.full_like(c, 7.0) for c in caches]
        with copy_isa(cap):
            conn.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots)
            conn.batched_to_gpu(objs, starts, ends, kvcaches=target, slot_mapping=skip)
        results.append(([o.tensor.clone() for o in objs], target))
    return results


def assert_all_equal(results):
    (first_objs, first_caches), *others = results
    for objs, caches in others:
        for a, b in zip(first_objs, objs):
            assert torch.equal(a, b)
        for a, b in zip(first_caches, caches):
            assert torch.equal(a, b)


def write(layout: PackedLayout, caches, k, v, slots):
    """What vLLM's kernel writes, by the layout's permutations: token i's K/V ([L, n, h, d]) at
    slot slots[i] of every layer's cache [num_blocks, h, bs, 2d]."""
    bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_size
    for layer, kv in enumerate(caches):
        flat = kv.view(kv.shape[0], -1)
        for i, s in enumerate(slots.tolist()):
            b, t = divmod(s, bs)
            flat[b, layout.k_perm.view(bs, h, d)[t]] = k[layer, i]
            flat[b, layout.v_perm.view(bs, h, d)[t]] = v[layer, i]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_each_measured_layout_is_its_isas_closed_form(case):
    sample = measured(case)
    closed = closed_form_layout(case["num_kv_heads"], case["head_size"], case["block_size"], case["isa"])
    assert torch.equal(sample.k_perm, closed.k_perm) and torch.equal(sample.v_perm, closed.v_perm)
    assert sample.kind == isa_kind(case["isa"])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_live_probe_finds_the_measured_layout_where_vllms_kernel_runs(case):
    pytest.importorskip("vllm._custom_ops")
    skip_unless_vllm_writes(case["isa"])
    probed = probe_packed_layout(case["num_kv_heads"], case["head_size"], case["block_size"],
                                 DTYPES[case["dtype"]], case["isa"])
    sample = measured(case)
    assert torch.equal(probed.k_perm, sample.k_perm) and torch.equal(probed.v_perm, sample.v_perm)
    assert packed_layout(case["num_kv_heads"], case["head_size"], case["block_size"],
                         DTYPES[case["dtype"]], case["isa"]).kind == sample.kind


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("use_native", [True, False])
def test_a_request_round_trips_through_each_measured_layout(case, use_native):
    """Written as vLLM's kernel writes it (by the measured permutation), gathered into chunk
    objects, and scattered back into an empty cache: the same bytes."""
    layout, dtype = measured(case), DTYPES[case["dtype"]]
    h, d, bs = layout.num_kv_heads, layout.head_size, layout.block_size
    layers, nb = 2, 6
    n = 2 * bs + bs // 2 + 3  # two whole blocks, then a partial one
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randperm(nb, generator=gen)[: -(-n // bs)]
    slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[:n]
    k, v = (torch.randn(layers, n, h, d, generator=gen).to(dtype) for _ in range(2))
    caches = [torch.zeros(nb, h, bs, 2 * d, dtype=dtype) for _ in range(layers)]
    write(layout, caches, k, v, slots)
    conn = VLLMCPUPackedConnector(h * d, layers, layout, use_native=use_native)
    assert (conn._native is not None) == use_native  # the native copy serves every measured kind
    sizes = [bs, n - bs]
    alloc = HostMemoryAllocator(1 << 24)
    objs = [alloc.allocate(conn.get_shape(m), dtype, MemoryFormat.KV_BLOB) for m in sizes]
    conn.batched_from_gpu(objs, [0, bs], [bs, n], kvcaches=caches, slot_mapping=slots)
    got = torch.cat([o.tensor for o in objs], dim=2)
    assert torch.equal(got[0], k.view(layers, n, h * d)) and torch.equal(got[1], v.view(layers, n, h * d))
    back = [torch.zeros_like(c) for c in caches]
    conn.batched_to_gpu(objs, [0, bs], [bs, n], kvcaches=back, slot_mapping=slots)
    for a, b in zip(caches, back):
        assert torch.equal(a, b)


LAYOUTS = [("vec", torch.bfloat16, 2, 64, 32), ("vec", torch.float16, 3, 64, 32),
           ("vec", torch.float32, 2, 32, 16), ("vec16", torch.bfloat16, 2, 80, 32),
           ("amx", torch.bfloat16, 2, 64, 32), ("amx", torch.bfloat16, 1, 96, 64)]


@pytest.mark.parametrize("path", NATIVE_PATHS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(LAYOUTS) - 1), data=st.data())
def test_native_and_torch_copies_agree_on_any_slot_mapping(path, which, data):
    """Random requests over each layout: partial blocks, runs starting inside tiles, blocks out of
    order, several chunks, and on a retrieve tokens vLLM already holds (-1): the native copy and
    the torch one (the layout's permutations) give the same bytes both ways."""
    isa, dtype, h, d, bs = LAYOUTS[which]
    layout = closed_form_layout(h, d, bs, isa)
    layers, nb = 2, 8
    n = data.draw(st.integers(1, 3 * bs), label="tokens")
    slots = torch.tensor(data.draw(st.permutations(range(nb * bs)), label="slots")[:n])
    if data.draw(st.booleans(), label="runs"):  # vLLM-like: consecutive slots in shuffled blocks
        start = data.draw(st.integers(0, bs - 1), label="start")
        order = torch.tensor(data.draw(st.permutations(range(nb)), label="blocks"))
        slots = (order[:, None] * bs + torch.arange(bs)).flatten()[start: start + n]
        n = slots.shape[0]
    cut = data.draw(st.integers(1, n), label="chunk")
    bounds = [(0, cut), (cut, n)] if cut < n else [(0, n)]
    gen = torch.Generator().manual_seed(n)
    caches = [torch.randn(nb, h, bs, 2 * d, generator=gen).to(dtype) for _ in range(layers)]
    skip = slots.clone()
    skip[: data.draw(st.integers(0, n), label="held")] = -1
    assert_all_equal(copies(layout, layers, dtype, caches, slots, skip, bounds, path))


@pytest.mark.parametrize("isa,dtype,h,d", [("vec", torch.bfloat16, 4, 64), ("amx", torch.bfloat16, 4, 64),
                                           ("vec", torch.float32, 2, 64), ("vec16", torch.bfloat16, 4, 80)])
@pytest.mark.parametrize("path", NATIVE_PATHS)
@pytest.mark.parametrize("first", [0, 5])
def test_large_copies_stream_the_same_bytes(path, isa, dtype, h, d, first):
    """Copies of more than 8 MB write whole cache lines with non-temporal stores (AVX2, AVX-512):
    the same bytes as torch, with blocks out of order, a partial last block and (`first`) runs
    that start inside a block."""
    bs, layers, n = 128, 4, 4096 - 37
    nb = n // bs + 4
    layout = closed_form_layout(h, d, bs, isa)
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(nb, generator=gen)
    slots = (order[:, None] * bs + torch.arange(bs)).flatten()[first : first + n]
    caches = [torch.randn(nb, h, bs, 2 * d, generator=gen).to(dtype) for _ in range(layers)]
    assert 2 * layers * n * h * d * dtype.itemsize > 8 << 20
    bounds = [(a, min(a + 1024, n)) for a in range(0, n, 1024)]
    assert_all_equal(copies(layout, layers, dtype, caches, slots, slots, bounds, path))


@pytest.mark.parametrize("isa,dtype", [("vec", torch.bfloat16), ("vec", torch.float32),
                                       ("amx", torch.bfloat16)])
@pytest.mark.parametrize("use_native", [True, False])
def test_a_store_of_several_groups_writes_zeros_where_a_group_holds_no_token(isa, dtype, use_native):
    """Two KV cache groups: a layer of the group whose row is -1 (a sliding-window row outside what
    the chunk keeps) stores zeros there, not some other block's KV; natively and by torch alike."""
    h, d, bs, nb = 2, 64, 32, 6
    layout = closed_form_layout(h, d, bs, isa)
    conn = VLLMCPUPackedConnector(h * d, 2, layout, use_native=use_native, layer_groups=[0, 1])
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(nb, h, bs, 2 * d, generator=gen).to(dtype) for _ in range(2)]
    n = 2 * bs
    full = torch.arange(bs, bs + n)
    windowed = full.clone()
    windowed[: bs + 5] = -1  # the group keeps only the last rows (not block-aligned)
    obj = HostMemoryAllocator(1 << 22).allocate(conn.get_shape(n), dtype, MemoryFormat.KV_BLOB)
    conn.batched_from_gpu([obj], [0], [n], kvcaches=caches, slot_mapping=torch.stack([full, windowed]))
    assert obj.tensor is not None
    assert bool((obj.tensor[:, 1, : bs + 5] == 0).all())
    assert bool((obj.tensor[:, 1, bs + 5:] != 0).any()) and bool((obj.tensor[:, 0] != 0).any())


def test_a_kernel_that_runs_but_does_not_permute_kv_is_refused_not_replaced_by_the_closed_form(monkeypatch):
    """vLLM's kernel ran and wrote something that is no permutation of K and V (a build that
    quantizes, say): the connector refuses to serve rather than copy by a guessed layout."""
    from lmcache.integration.vllm import cpu_layout

    def writes_zeros(kv, key, value, slots, isa):
        kv[1] = 0

    monkeypatch.setattr(cpu_layout, "_write", writes_zeros)
    with pytest.raises(cpu_layout.LayoutMismatch, match="permutation"):
        cpu_layout.packed_layout.__wrapped__(1, 16, 16, torch.float32, "vec")
