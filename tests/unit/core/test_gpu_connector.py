"""The KV connectors on CPU tensors: every layout through every copy path (native kernel, torch ops,
forced staged path), the slot rules and the errors."""

import pytest
import torch

from lmcache.gpu_connector import (
    TokenMajorConnector,
    VLLMNestedTupleGPUConnector,
    VLLMPagedMemGPUConnector,
    VLLMPagedMemGPUConnectorV2,
)
from lmcache.memory_management import HostMemoryAllocator, MemoryFormat
from tests.helpers.copy_paths import NATIVE_PATHS, copy_isa
from tests.helpers.paged_kv import LAYOUTS, PAGED, KVCache

L, H, D, BS, NB = 3, 2, 8, 4, 16
HIDDEN = H * D
PATHS = {"native": {}, "torch": {"use_native": False}, "staged": {"staged": True}}


def obj_for(conn, n, dtype=torch.bfloat16, alloc=None):
    alloc = alloc or HostMemoryAllocator(1 << 20)
    return alloc.allocate(conn.get_shape(n), dtype, MemoryFormat.KV_BLOB)


def objs_for(conn, sizes, dtype=torch.bfloat16):
    alloc = HostMemoryAllocator(1 << 20)
    return [obj_for(conn, n, dtype, alloc) for n in sizes]


def cache(layout, **kw):
    return KVCache(layout, layers=L, heads=H, head_size=D, block_size=BS, num_blocks=NB, **kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_from_gpu_gathers_the_tokens_of_a_range_in_order(layout, path):
    kv = cache(layout)
    conn = kv.connector(**PATHS[path])
    slots = kv.slots_for(22)
    obj = obj_for(conn, 10)
    conn.from_gpu(obj, 5, 15, **kv.kwargs(slots))
    assert torch.equal(obj.tensor, kv.rows(slots[5:15]))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_request_of_several_chunks_round_trips_and_writes_nothing_else(layout, path):
    src = cache(layout)
    conn = src.connector(**PATHS[path])
    slots = src.slots_for(45)
    starts, ends = [0, 16, 32], [16, 32, 45]  # a trailing partial chunk
    objs = objs_for(conn, [16, 16, 13])
    conn.batched_from_gpu(objs, starts, ends, **src.kwargs(slots))
    for obj, a, b in zip(objs, starts, ends):
        assert torch.equal(obj.tensor, src.rows(slots[a:b]))
    dst = src.zeros_like()
    done = []
    conn.batched_to_gpu(objs, starts, ends, on_done=done.append, **dst.kwargs(slots))
    assert done == [None]
    written = torch.zeros(src.num_slots, dtype=torch.bool)
    written[slots] = True
    assert torch.equal(dst.all_rows()[:, :, written], src.all_rows()[:, :, written])
    assert not dst.all_rows()[:, :, ~written].any()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", PAGED)
def test_scattered_unaligned_slots_round_trip(layout, path):
    src = cache(layout)
    conn = src.connector(**PATHS[path])
    slots = torch.randperm(NB * BS)[:30]
    obj = obj_for(conn, 30)
    conn.from_gpu(obj, 0, 30, **src.kwargs(slots))
    assert torch.equal(obj.tensor, src.rows(slots))
    dst = src.zeros_like()
    conn.to_gpu(obj, 0, 30, **dst.kwargs(slots))
    assert torch.equal(dst.rows(slots), src.rows(slots))


@pytest.mark.parametrize("path", PATHS)
def test_store_rejects_minus_one_slots_and_retrieve_leaves_those_tokens_untouched(path):
    """vLLM marks the tokens its own prefix cache holds with -1 inside the first chunk it loads
    (its blocks are 16/128 tokens, LMCache chunks 256): a retrieve must skip them, a store has
    nothing to store for them."""
    src = cache("flash_attn")
    conn = src.connector(**PATHS[path])
    blocks = src.slots_for(16)
    obj = obj_for(conn, 16)
    conn.from_gpu(obj, 0, 16, **src.kwargs(blocks))
    slots = blocks.clone()
    slots[:6] = -1
    with pytest.raises(ValueError, match="negative"):
        conn.from_gpu(obj, 0, 16, **src.kwargs(slots))
    dst = src.zeros_like()
    for t in dst.kvcaches:
        t.fill_(7.0)
    conn.to_gpu(obj, 0, 16, **dst.kwargs(slots))
    assert torch.equal(dst.rows(blocks[6:]), src.rows(blocks[6:]))
    assert bool((dst.rows(blocks[:6]) == 7.0).all())
    untouched = torch.ones(NB * BS, dtype=torch.bool)
    untouched[blocks[6:]] = False
    assert bool((dst.all_rows()[:, :, untouched] == 7.0).all())


@pytest.mark.parametrize("path", PATHS)
def test_every_path_calls_on_done_exactly_once_and_an_empty_request_too(path):
    kv = cache("kv_tuples")
    conn = kv.connector(**PATHS[path])
    slots = kv.slots_for(8)
    calls = []
    conn.batched_from_gpu([obj_for(conn, 8)], [0], [8], on_done=calls.append, **kv.kwargs(slots))
    conn.batched_to_gpu([], [], [], on_done=calls.append, **kv.kwargs(slots))
    assert calls == [None, None]


@pytest.mark.parametrize("path", NATIVE_PATHS)
@pytest.mark.parametrize("layout", ["flash_attn", "kv_tuples"])
def test_large_native_copies_on_each_vector_path_move_the_slots_rows(layout, path):
    """A request over 8 MB (where the native copies stream whole cache lines on the AVX2 and
    AVX-512 paths): blocks out of order, runs cut at odd places, rows of 480 bytes (runs start
    and end inside cache lines), a partial last block."""
    src = KVCache(layout, layers=6, heads=6, head_size=40, block_size=16, num_blocks=160)
    slots = src.slots_for(2048)
    slots = torch.cat([slots[:100], slots[103:1500], slots[1501:2040]])  # runs of odd lengths
    n = slots.shape[0]
    conn = src.connector()
    alloc = HostMemoryAllocator(2 * n * conn.get_shape(1).numel() + (1 << 20))
    starts, ends = [0, 1000], [1000, n]
    objs = [alloc.allocate(conn.get_shape(b - a), torch.bfloat16, MemoryFormat.KV_BLOB)
            for a, b in zip(starts, ends)]
    assert 2 * 6 * n * 6 * 40 * 2 > 8 << 20
    dst = src.zeros_like()
    with copy_isa(path):
        conn.batched_from_gpu(objs, starts, ends, **src.kwargs(slots))
        conn.batched_to_gpu(objs, starts, ends, **dst.kwargs(slots))
    for obj, a, b in zip(objs, starts, ends):
        assert torch.equal(obj.tensor, src.rows(slots[a:b]))
    assert torch.equal(dst.rows(slots), src.rows(slots))


def test_paths_agree_bit_for_bit_on_float32():
    kv = cache("flash_attn", dtype=torch.float32)
    slots = torch.randperm(NB * BS)[:30]
    out = []
    for options in PATHS.values():
        conn = VLLMPagedMemGPUConnector(HIDDEN, L, **options)
        obj = obj_for(conn, 30, torch.float32)
        conn.from_gpu(obj, 0, 30, **kv.kwargs(slots))
        out.append(obj.tensor.clone())
    assert all(torch.equal(out[0], o) for o in out[1:])


def test_paged_layout_is_inferred_from_the_form_or_named():
    fi = cache("flashinfer")
    slots = fi.slots_for(8)
    named = VLLMPagedMemGPUConnectorV2(HIDDEN, L, layout="flashinfer")
    for conn in (named, VLLMPagedMemGPUConnectorV2(HIDDEN, L)):
        obj = obj_for(conn, 8)
        conn.from_gpu(obj, 0, 8, **fi.kwargs(slots))
        assert torch.equal(obj.tensor, fi.rows(slots))
    with pytest.raises(ValueError, match="flash_attn"):
        VLLMPagedMemGPUConnectorV2(HIDDEN, L, layout="flash_attn").from_gpu(
            obj_for(named, 8), 0, 8, **fi.kwargs(slots))
    with pytest.raises(ValueError, match="unknown paged KV layout"):
        VLLMPagedMemGPUConnectorV2(HIDDEN, L, layout="nhd").from_gpu(
            obj_for(named, 8), 0, 8, **fi.kwargs(slots))


@pytest.mark.parametrize("cls", [VLLMPagedMemGPUConnector, VLLMPagedMemGPUConnectorV2])
def test_paged_missing_kwargs_raise_value_error(cls):
    conn = cls(HIDDEN, L)
    kv = cache("kv_tuples")
    obj = obj_for(conn, 4)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.from_gpu(obj, 0, 4, slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping"):
        conn.from_gpu(obj, 0, 4, kvcaches=kv.kvcaches)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.to_gpu(obj, 0, 4, slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping"):
        conn.to_gpu(obj, 0, 4, kvcaches=kv.kvcaches)


def test_paged_rejects_mismatched_shapes_dtypes_and_short_slot_mappings():
    conn = VLLMPagedMemGPUConnector(HIDDEN, L)
    kv = cache("kv_tuples").kvcaches
    obj = obj_for(conn, 4)
    with pytest.raises(ValueError, match="shape"):
        conn.from_gpu(obj, 0, 5, kvcaches=kv, slot_mapping=torch.arange(5))
    with pytest.raises(ValueError, match="dtype"):
        conn.from_gpu(obj, 0, 4, kvcaches=cache("kv_tuples", dtype=torch.float32).kvcaches,
                      slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="cover"):
        conn.from_gpu(obj, 0, 4, kvcaches=kv, slot_mapping=torch.arange(3))
    with pytest.raises(ValueError, match="layers"):
        conn.from_gpu(obj, 0, 4, kvcaches=kv[:2], slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="outside"):
        conn.from_gpu(obj, 0, 4, kvcaches=kv, slot_mapping=torch.tensor([0, 1, 2, NB * BS]))
    with pytest.raises(ValueError, match="outside"):
        conn.to_gpu(obj, 0, 4, kvcaches=kv, slot_mapping=torch.tensor([0, 1, 2, NB * BS]))
    with pytest.raises(ValueError, match="heads \\* head_size"):
        conn.from_gpu(obj, 0, 4, kvcaches=[(k[..., :4], v[..., :4]) for k, v in kv],
                      slot_mapping=torch.arange(4))


@pytest.mark.parametrize("path", PATHS)
def test_a_per_group_slot_mapping_is_refused_by_the_one_group_paged_connector(path):
    """A [G, T] mapping (one slot row per KV cache group) is for connectors whose layers belong to
    several groups; the paged connector has one group: every path refuses it, none copies row 0
    for every layer."""
    kv = cache("flash_attn")
    conn = kv.connector(**PATHS[path])
    slots = kv.slots_for(8)
    obj = obj_for(conn, 8)
    for rows in (torch.stack([slots, slots.flip(0)]), slots[None]):
        with pytest.raises(ValueError, match="one slot row"):
            conn.from_gpu(obj, 0, 8, kvcaches=kv.kvcaches, slot_mapping=rows)
        with pytest.raises(ValueError, match="one slot row"):
            conn.to_gpu(obj, 0, 8, kvcaches=kv.kvcaches, slot_mapping=rows)


@pytest.mark.parametrize("path", PATHS)
def test_paged_connector_reads_non_contiguous_hnd_caches(path):
    conn = VLLMPagedMemGPUConnector(HIDDEN, L, **PATHS[path])
    base = [torch.randn(NB, H, BS, D).to(torch.bfloat16) for _ in range(2 * L)]
    kv = [(base[2 * i].transpose(1, 2), base[2 * i + 1].transpose(1, 2)) for i in range(L)]
    slots = torch.randperm(NB * BS)[:8]
    obj = obj_for(conn, 8)
    conn.from_gpu(obj, 0, 8, kvcaches=kv, slot_mapping=slots)
    expected = torch.stack([torch.stack([layer[i].reshape(-1, HIDDEN)[slots] for layer in kv])
                            for i in (0, 1)])
    assert torch.equal(obj.tensor, expected)


def test_the_seed_nested_tuple_name_is_the_token_major_connector():
    assert VLLMNestedTupleGPUConnector is TokenMajorConnector


@pytest.mark.parametrize("tail", [(H, D), (HIDDEN,)])
def test_nested_tuple_round_trip(tail):
    conn = VLLMNestedTupleGPUConnector(HIDDEN, L)
    src = tuple((torch.randn(20, *tail), torch.randn(20, *tail)) for _ in range(L))
    dst = tuple((torch.zeros(20, *tail), torch.zeros(20, *tail)) for _ in range(L))
    obj = obj_for(conn, 7, torch.float32)
    conn.from_gpu(obj, 10, 17, kvcaches=src)
    assert torch.equal(obj.tensor[0, 1], src[1][0][10:17].reshape(7, HIDDEN))
    assert torch.equal(obj.tensor[1, 2], src[2][1][10:17].reshape(7, HIDDEN))
    conn.to_gpu(obj, 10, 17, kvcaches=dst)
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[10:17], sk[10:17]) and torch.equal(dv[10:17], sv[10:17])
        assert bool((dk[:10] == 0).all()) and bool((dk[17:] == 0).all())


def test_nested_tuple_errors():
    conn = VLLMNestedTupleGPUConnector(HIDDEN, L)
    obj = obj_for(conn, 4, torch.float32)

    def nested(n, dtype=torch.float32):
        return tuple((torch.randn(n, H, D, dtype=dtype), torch.randn(n, H, D, dtype=dtype)) for _ in range(L))

    with pytest.raises(ValueError, match="kvcaches"):
        conn.from_gpu(obj, 0, 4)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.to_gpu(obj, 0, 4)
    with pytest.raises(ValueError, match="cannot provide"):
        conn.from_gpu(obj, 0, 4, kvcaches=nested(3))
    with pytest.raises(ValueError, match="dtype"):
        conn.from_gpu(obj, 0, 4, kvcaches=nested(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="3 per-layer"):
        conn.from_gpu(obj, 0, 4, kvcaches=nested(4)[:2])
    blob = HostMemoryAllocator(1 << 16).allocate((64,), torch.uint8, MemoryFormat.BINARY)
    with pytest.raises(ValueError, match="KV_BLOB"):
        conn.from_gpu(blob, 0, 4, kvcaches=nested(4))
    with pytest.raises(ValueError, match="num_kv_heads"):
        TokenMajorConnector(HIDDEN, L, num_kv_heads=3, head_size=D)


def test_from_gpu_marks_undefined_objects_as_kv_blob():
    conn = VLLMNestedTupleGPUConnector(HIDDEN, L)
    obj = HostMemoryAllocator(1 << 16).allocate(conn.get_shape(4), torch.float32, MemoryFormat.UNDEFINED)
    kv = tuple((torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)) for _ in range(L))
    conn.from_gpu(obj, 0, 4, kvcaches=kv)
    assert obj.get_memory_format() == MemoryFormat.KV_BLOB
