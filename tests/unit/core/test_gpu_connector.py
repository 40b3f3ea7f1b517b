import pytest
import torch

from lmcache.gpu_connector import (
    VLLMNestedTupleGPUConnector,
    VLLMPagedMemGPUConnector,
    VLLMPagedMemGPUConnectorV2,
)
from lmcache.memory_management import HostMemoryAllocator, MemoryFormat

L, H, D, BS, NB = 3, 2, 8, 4, 16
HIDDEN = H * D


def obj_for(conn, n, dtype=torch.bfloat16, alloc=None):
    alloc = alloc or HostMemoryAllocator(1 << 20)
    return alloc.allocate(conn.get_shape(n), dtype, MemoryFormat.KV_BLOB)


def paged_tuples(dtype=torch.bfloat16):
    return [(torch.randn(NB, BS, H, D).to(dtype), torch.randn(NB, BS, H, D).to(dtype)) for _ in range(L)]


def expected_blob(kv, slots):
    k = torch.stack([layer[0].reshape(-1, HIDDEN)[slots] for layer in kv])
    v = torch.stack([layer[1].reshape(-1, HIDDEN)[slots] for layer in kv])
    return torch.stack([k, v])


def scattered_slots(n, aligned=True):
    blocks = torch.randperm(NB)[: (n + BS - 1) // BS]
    slots = (blocks[:, None] * BS + torch.arange(BS)).flatten()[:n]
    return slots if aligned else torch.randperm(NB * BS)[:n]


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("aligned", [True, False])
def test_paged_from_gpu_gathers_slots_in_order(use_native, aligned):
    conn = VLLMPagedMemGPUConnector(HIDDEN, L, use_native=use_native)
    kv = paged_tuples()
    slots = scattered_slots(22, aligned)
    obj = obj_for(conn, 10)
    conn.from_gpu(obj, 5, 15, kvcaches=kv, slot_mapping=slots)
    assert torch.equal(obj.tensor, expected_blob(kv, slots[5:15]))


@pytest.mark.parametrize("use_native", [True, False])
def test_paged_to_gpu_scatters_only_the_given_slots(use_native):
    conn = VLLMPagedMemGPUConnector(HIDDEN, L, use_native=use_native)
    src = paged_tuples()
    dst = [(torch.zeros(NB, BS, H, D, dtype=torch.bfloat16), torch.zeros(NB, BS, H, D, dtype=torch.bfloat16))
           for _ in range(L)]
    slots = scattered_slots(16, aligned=False)
    obj = obj_for(conn, 16)
    conn.from_gpu(obj, 0, 16, kvcaches=src, slot_mapping=slots)
    conn.to_gpu(obj, 0, 16, kvcaches=dst, slot_mapping=slots)
    for (sk, sv), (dk, dv) in zip(src, dst):
        for s, d in ((sk, dk), (sv, dv)):
            s, d = s.reshape(-1, HIDDEN), d.reshape(-1, HIDDEN)
            assert torch.equal(d[slots], s[slots])
            untouched = torch.ones(NB * BS, dtype=torch.bool)
            untouched[slots] = False
            assert bool((d[untouched] == 0).all())


def test_native_and_torch_paths_agree_bit_for_bit():
    kv = paged_tuples(torch.float32)
    slots = scattered_slots(30, aligned=False)
    out = []
    for use_native in (True, False):
        conn = VLLMPagedMemGPUConnector(HIDDEN, L, use_native=use_native)
        obj = obj_for(conn, 30, torch.float32)
        conn.from_gpu(obj, 0, 30, kvcaches=kv, slot_mapping=slots)
        out.append(obj.tensor.clone())
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("use_native", [True, False])
def test_both_paged_connectors_take_both_kv_forms_with_identical_results(use_native):
    tuples = paged_tuples()
    v1_tensors = [torch.stack([k, v]) for k, v in tuples]  # vLLM v1: [2, num_blocks, bs, H, D]
    slots = scattered_slots(22, aligned=False)
    expected = expected_blob(tuples, slots[3:19])
    for cls in (VLLMPagedMemGPUConnector, VLLMPagedMemGPUConnectorV2):
        conn = cls(HIDDEN, L, use_native=use_native)
        for kv, empty in ((tuples, [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in tuples]),
                          (v1_tensors, [torch.zeros_like(t) for t in v1_tensors])):
            obj = obj_for(conn, 16)
            conn.batched_from_gpu([obj], [3], [19], kvcaches=kv, slot_mapping=slots)
            assert torch.equal(obj.tensor, expected), (cls.__name__, type(kv[0]))
            conn.batched_to_gpu([obj], [3], [19], kvcaches=empty, slot_mapping=slots)
            back = [(t[0], t[1]) for t in empty] if isinstance(empty[0], torch.Tensor) else empty
            assert torch.equal(expected_blob(back, slots[3:19]), expected)
            assert sum(int((t != 0).sum()) for layer in back for t in layer) == int((expected != 0).sum())


def test_v2_rejects_a_range_overlapping_the_minus_one_prefix():
    conn = VLLMPagedMemGPUConnectorV2(HIDDEN, L)
    kv = paged_tuples()
    slots = torch.cat([torch.full((8,), -1), scattered_slots(8)])
    obj = obj_for(conn, 8)
    conn.from_gpu(obj, 8, 16, kvcaches=kv, slot_mapping=slots)  # fine: after the prefix
    with pytest.raises(ValueError, match="outside"):
        conn.from_gpu(obj, 4, 12, kvcaches=kv, slot_mapping=slots)
    with pytest.raises(ValueError, match="outside"):
        conn.to_gpu(obj, 4, 12, kvcaches=kv, slot_mapping=slots)


@pytest.mark.parametrize("cls", [VLLMPagedMemGPUConnector, VLLMPagedMemGPUConnectorV2])
def test_paged_missing_kwargs_raise_value_error(cls):
    conn = cls(HIDDEN, L)
    obj = obj_for(conn, 4)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.from_gpu(obj, 0, 4, slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping"):
        conn.from_gpu(obj, 0, 4, kvcaches=paged_tuples())
    with pytest.raises(ValueError, match="kvcaches"):
        conn.to_gpu(obj, 0, 4, slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping"):
        conn.to_gpu(obj, 0, 4, kvcaches=paged_tuples())


def test_paged_rejects_mismatched_shapes_dtypes_and_short_slot_mappings():
    conn = VLLMPagedMemGPUConnector(HIDDEN, L)
    obj = obj_for(conn, 4)
    with pytest.raises(ValueError, match="shape"):
        conn.from_gpu(obj, 0, 5, kvcaches=paged_tuples(), slot_mapping=torch.arange(5))
    with pytest.raises(ValueError, match="dtype"):
        conn.from_gpu(obj, 0, 4, kvcaches=paged_tuples(torch.float32), slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="cover"):
        conn.from_gpu(obj, 0, 4, kvcaches=paged_tuples(), slot_mapping=torch.arange(3))
    with pytest.raises(ValueError, match="layers"):
        conn.from_gpu(obj, 0, 4, kvcaches=paged_tuples()[:2], slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="outside"):
        conn.from_gpu(obj, 0, 4, kvcaches=paged_tuples(), slot_mapping=torch.tensor([0, 1, 2, NB * BS]))


def test_paged_connector_reads_non_contiguous_caches_through_torch():
    conn = VLLMPagedMemGPUConnector(HIDDEN, L)
    base = [torch.randn(NB, H, BS, D).to(torch.bfloat16) for _ in range(2 * L)]
    kv = [(base[2 * i].transpose(1, 2), base[2 * i + 1].transpose(1, 2)) for i in range(L)]
    slots = scattered_slots(8)
    obj = obj_for(conn, 8)
    conn.from_gpu(obj, 0, 8, kvcaches=kv, slot_mapping=slots)
    assert torch.equal(obj.tensor, expected_blob(kv, slots))


def nested(n, shape_tail=(H, D), dtype=torch.float32):
    return tuple((torch.randn(n, *shape_tail, dtype=dtype), torch.randn(n, *shape_tail, dtype=dtype))
                 for _ in range(L))


@pytest.mark.parametrize("tail", [(H, D), (HIDDEN,)])
def test_nested_tuple_round_trip(tail):
    conn = VLLMNestedTupleGPUConnector(HIDDEN, L)
    src, dst = nested(20, tail), tuple((torch.zeros(20, *tail), torch.zeros(20, *tail)) for _ in range(L))
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
    with pytest.raises(ValueError, match="kvcaches"):
        conn.from_gpu(obj, 0, 4)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.to_gpu(obj, 0, 4)
    with pytest.raises(ValueError, match="cannot provide"):
        conn.from_gpu(obj, 0, 4, kvcaches=nested(3))
    with pytest.raises(ValueError, match="dtype"):
        conn.from_gpu(obj, 0, 4, kvcaches=nested(4, dtype=torch.float16))
    blob = HostMemoryAllocator(1 << 16).allocate((64,), torch.uint8, MemoryFormat.BINARY)
    with pytest.raises(ValueError, match="KV_BLOB"):
        conn.from_gpu(blob, 0, 4, kvcaches=nested(4))


def test_from_gpu_marks_undefined_objects_as_kv_blob():
    conn = VLLMNestedTupleGPUConnector(HIDDEN, L)
    obj = HostMemoryAllocator(1 << 16).allocate(conn.get_shape(4), torch.float32, MemoryFormat.UNDEFINED)
    conn.from_gpu(obj, 0, 4, kvcaches=nested(4))
    assert obj.get_memory_format() == MemoryFormat.KV_BLOB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_connector_on_cuda_round_trips_into_host_memory():
    conn = VLLMPagedMemGPUConnectorV2(HIDDEN, L, use_gpu=True)
    kv = [torch.randn(2, NB, BS, H, D, device="cuda").to(torch.bfloat16) for _ in range(L)]
    slots = scattered_slots(12).cuda()
    obj = obj_for(conn, 12)
    conn.from_gpu(obj, 0, 12, kvcaches=kv, slot_mapping=slots)
    out = [torch.zeros_like(t) for t in kv]
    conn.to_gpu(obj, 0, 12, kvcaches=out, slot_mapping=slots)
    for a, b in zip(kv, out):
        assert torch.equal(a.view(2, -1, HIDDEN)[:, slots], b.view(2, -1, HIDDEN)[:, slots])
