import io
import pickle
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.storage_backend.serde import CorruptBlobError, ForeignSerdeError, blob, create_serde

SERDES = ["naive", "fast", "torch", "safe"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


def serde_pair(name, meta, dtype=torch.bfloat16):
    meta.kv_dtype = dtype
    return create_serde(name, LMCacheEngineConfig.from_defaults(), meta)


@pytest.mark.parametrize("name", SERDES)
@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=1, max_size=4), dtype=st.sampled_from(DTYPES))
def test_round_trip_is_bit_exact_for_any_shape_and_dtype(name, shape, dtype):
    t = (torch.randn(shape) * 50).to(dtype)
    meta = LMCacheEngineMetadata("m", 1, 0, "vllm", dtype, (1, 2, 8, 1, 4))
    ser, deser = create_serde(name, LMCacheEngineConfig.from_defaults(), meta)
    out = deser.from_bytes(ser.to_bytes(t))
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)


@pytest.mark.parametrize("name", SERDES)
def test_from_bytes_to_fills_a_buffer_from_allocate(name, meta, make_obj, allocator):
    src = make_obj(1)
    ser, deser = serde_pair(name, meta)
    obj = deser.from_bytes_to(ser.to_bytes(src.tensor), allocator.allocate)
    assert obj is not None and obj.get_ref_count() == 1
    assert torch.equal(obj.tensor, src.tensor)
    assert obj.tensor.data_ptr() != src.tensor.data_ptr()


@pytest.mark.parametrize("name", SERDES)
def test_from_bytes_to_returns_none_when_allocate_has_no_room(name, meta, make_obj):
    ser, deser = serde_pair(name, meta)
    assert deser.from_bytes_to(ser.to_bytes(make_obj(2).tensor), lambda *a: None) is None


@pytest.mark.parametrize("name", SERDES)
def test_to_parts_concatenate_to_to_bytes(name, meta, make_obj):
    t = make_obj(3).tensor
    ser, _ = serde_pair(name, meta)
    assert b"".join(bytes(p) for p in ser.to_parts(t)) == ser.to_bytes(t)


@pytest.mark.parametrize("name", SERDES)
@pytest.mark.parametrize("damage", ["truncate", "extend", "flip_payload", "flip_header", "dim_overflow",
                                    "numel_overflow", "empty"])
def test_damaged_blob_raises_corrupt_blob_error(name, damage, meta, make_obj):
    ser, deser = serde_pair(name, meta)
    data = bytearray(ser.to_bytes(make_obj(4).tensor))
    if damage == "truncate":
        data = data[:-7]
    elif damage == "extend":
        data += b"\0"
    elif damage == "flip_payload":
        data[blob.HEADER_SIZE + len(data) // 3] ^= 0x10
    elif damage == "flip_header":
        data[20] ^= 0x01  # a shape dimension
    elif damage == "dim_overflow":
        data[8 + 7] ^= 0x80  # the top bit of the first dim: >= 2**63, beyond an int64
    elif damage == "numel_overflow":
        data[8:40] = struct.pack("<4Q", *[1 << 40] * 4)  # each dim fine, their product is not
    else:
        data = bytearray()
    with pytest.raises(CorruptBlobError):
        deser.from_bytes(bytes(data))
    with pytest.raises(CorruptBlobError):
        deser.from_bytes_to(bytes(data), lambda *a: pytest.fail("allocated for a corrupt blob"))


def test_blob_of_another_serde_is_foreign_not_corrupt(meta, make_obj):
    t = make_obj(5).tensor
    data = serde_pair("torch", meta)[0].to_bytes(t)
    with pytest.raises(ForeignSerdeError):
        serde_pair("naive", meta)[1].from_bytes(data)


def test_torch_serde_never_unpickles_code(meta, tmp_path):
    """A blob with a valid header and checksum whose payload is a malicious pickle must not run."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf, pickle_module=pickle)
    payload = buf.getvalue()
    data = blob.pack_header("torch", (2,), torch.bfloat16, payload) + payload
    with pytest.raises(CorruptBlobError):
        serde_pair("torch", meta)[1].from_bytes(data)
    assert not marker.exists()


def test_safe_serde_rejects_valid_safetensors_with_other_content(meta):
    from safetensors.torch import save

    payload = save({"other": torch.zeros(2, dtype=torch.bfloat16)})
    data = blob.pack_header("safe", (2,), torch.bfloat16, payload) + payload
    with pytest.raises(CorruptBlobError, match="expected one"):
        serde_pair("safe", meta)[1].from_bytes(data)


def test_deserializer_converts_to_its_dtype(meta):
    t = torch.randn(3, 4)
    data = serde_pair("naive", meta, torch.float32)[0].to_bytes(t)
    out = serde_pair("naive", meta, torch.bfloat16)[1].from_bytes(data)
    assert out.dtype == torch.bfloat16 and torch.equal(out, t.to(torch.bfloat16))


def test_fast_from_bytes_is_a_zero_copy_view(meta):
    t = torch.arange(16, dtype=torch.bfloat16)
    data = bytearray(serde_pair("fast", meta)[0].to_bytes(t))
    out = serde_pair("fast", meta)[1].from_bytes(data)
    data[blob.HEADER_SIZE : blob.HEADER_SIZE + 2] = torch.tensor([99.0], dtype=torch.bfloat16).view(
        torch.uint8).numpy().tobytes()
    assert out[0].item() == 99.0  # the tensor aliases the bytes


def test_payload_verifier_accepts_pieces_and_rejects_a_short_payload(make_obj):
    t = make_obj(6).tensor
    payload = t.view(torch.uint8).flatten().numpy().tobytes()
    head = blob.pack_header("naive", t.shape, t.dtype, payload)
    header = blob.parse_header(head)
    v = blob.PayloadVerifier(head, header)
    for i in range(0, len(payload), 100):
        v.update(payload[i : i + 100])
    v.finish()
    short = blob.PayloadVerifier(head, header)
    short.update(payload[:-1])
    with pytest.raises(CorruptBlobError, match="payload bytes"):
        short.finish()


def test_unknown_serde_name_is_rejected(meta):
    with pytest.raises(ValueError, match="unknown serde"):
        create_serde("zip", LMCacheEngineConfig.from_defaults(), meta)


def test_torch_blob_of_a_view_does_not_carry_the_surrounding_buffer(meta):
    arena = torch.zeros(1 << 16, dtype=torch.bfloat16)
    ser, deser = serde_pair("torch", meta)
    data = ser.to_bytes(arena[:16])
    assert len(data) < 4096 and torch.equal(deser.from_bytes(data), arena[:16])


def test_the_header_of_a_typed_buffer_counts_its_bytes_not_its_items():
    """`pack_header` takes any buffer: a float32 memoryview's length is in items, its payload in
    bytes."""
    import numpy as np

    values = np.arange(4, dtype=np.float32)
    for payload in (memoryview(values), [memoryview(values[:2]), memoryview(values[2:])]):
        data = blob.pack_header("naive", (4,), torch.float32, payload) + values.tobytes()
        b = blob.unpack(data, "naive")
        assert b.shape == (4,) and bytes(b.payload) == values.tobytes()
