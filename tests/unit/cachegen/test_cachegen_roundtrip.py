"""Serializer -> deserializer round trips: shape, dtype, device, error bound, size."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lmcache.cachegen.config import CacheGenConfig
from lmcache.cachegen.decoder import StreamTables, decode_kv, decode_stream
from lmcache.cachegen.encoded import CacheGenGPUEncoderOutput
from lmcache.cachegen.encoder import encode_stream
from lmcache.cachegen.kernels import kernels
from lmcache.cachegen.quant import steps
from lmcache.cachegen.serde import CacheGenDeserializer, CacheGenSerializer
from lmcache.compat.cachegen_seed import decode_chunk, decode_function_gpu, encode_function
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.storage_backend.serde import create_serde


def test_registry_builds_the_cachegen_pair(engine_config, metadata) -> None:
    ser, de = create_serde("cachegen", engine_config, metadata)
    assert isinstance(ser, CacheGenSerializer) and isinstance(de, CacheGenDeserializer)


def test_an_engine_of_mla_latents_cannot_use_cachegen(engine_config) -> None:
    mla = LMCacheEngineMetadata("ds", 1, 0, "vllm", torch.bfloat16, (3, 1, engine_config.chunk_size, 1, 576))
    with pytest.raises(ValueError, match="one latent per token and layer"):
        create_serde("cachegen", engine_config, mla)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_roundtrip_keeps_shape_dtype_device_within_half_a_step(serde, make_kv, within_half_step,
                                                                dtype: torch.dtype) -> None:
    ser, de = serde
    kv = make_kv(dtype=dtype)
    data = ser.to_bytes(kv)
    out = de.from_bytes(data)
    assert out.shape == kv.shape and out.dtype == dtype and out.device == kv.device
    within_half_step(kv, out, data)


@pytest.mark.parametrize("ntokens", [1, 2, 17, 63])
def test_trailing_partial_chunks_roundtrip(serde, make_kv, within_half_step, dims,
                                           ntokens: int) -> None:
    ser, de = serde
    kv = make_kv(ntokens=ntokens, seed=ntokens)
    data = ser.to_bytes(kv)
    out = de.from_bytes(data)
    assert out.shape == (2, dims["nlayers"], ntokens, dims["hidden"])
    within_half_step(kv, out, data)


def test_compresses_kv_like_data_well_below_8_bits(serde, make_kv) -> None:
    ser, _ = serde
    kv = make_kv()
    assert len(ser.to_bytes(kv)) * 8 / kv.numel() < 6.0


def test_more_bins_give_smaller_error_and_larger_blobs(engine_config, metadata, make_kv,
                                                       dims) -> None:
    kv = make_kv()
    de = CacheGenDeserializer(engine_config, metadata, kv.dtype)
    sizes, errors = [], []
    for bins in (4, 16, 64):
        cfg = CacheGenConfig.uniform(dims["nlayers"], bins, bins)
        data = CacheGenSerializer(engine_config, metadata, cachegen_config=cfg).to_bytes(kv)
        sizes.append(len(data))
        errors.append(float((de.from_bytes(data).float() - kv.float()).pow(2).mean()))
    assert sizes[0] < sizes[1] < sizes[2]
    assert errors[0] > errors[1] > errors[2]


def test_constant_inputs_roundtrip_exactly(serde, dims) -> None:
    ser, de = serde
    shape = (2, dims["nlayers"], 8, dims["hidden"])
    for value in (0.0, 3.5, -1e-3):
        kv = torch.full(shape, value, dtype=torch.bfloat16)
        assert torch.equal(de.from_bytes(ser.to_bytes(kv)), kv)


def test_a_tiny_token_among_large_ones_stays_within_its_step(serde, make_kv,
                                                             within_half_step) -> None:
    ser, de = serde
    kv = make_kv(ntokens=16)
    kv[:, :, 5] *= 1e-6  # its step is raised so that |q| stays <= QMAX
    data = ser.to_bytes(kv)
    within_half_step(kv, de.from_bytes(data), data)


def test_rejects_non_finite_wrong_shape_and_integer_input(serde, make_kv, dims) -> None:
    ser, _ = serde
    kv = make_kv(ntokens=4)
    kv[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ser.to_bytes(kv)
    nl, hidden = dims["nlayers"], dims["hidden"]
    with pytest.raises(ValueError, match="KV_BLOB"):
        ser.to_bytes(torch.zeros(2, nl, 4, hidden + 1))
    with pytest.raises(ValueError, match="layers"):
        ser.to_bytes(torch.zeros(2, nl + 1, 4, hidden))
    with pytest.raises(ValueError, match="KV_BLOB"):  # the deserializer refuses more than a chunk
        ser.to_bytes(torch.zeros(2, nl, dims["chunk"] + 1, hidden))
    with pytest.raises(ValueError, match="floating-point"):
        ser.to_bytes(torch.zeros(2, nl, 4, hidden, dtype=torch.int32))


def test_token_blocks_decode_independently(make_kv, dims) -> None:
    kv = make_kv(ntokens=100)
    cfg = CacheGenConfig.default_for_layers(dims["nlayers"])
    kb, vb = torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins())
    blocks = encode_function(kv, cfg, kb, vb, chunk_size=32)
    assert [c.ntokens for c in blocks.data_chunks] == [32, 32, 32, 4]
    whole = decode_kv(blocks, kv.dtype)
    tables = StreamTables.of(blocks)
    for b in (3, 1, 2):  # any block alone, in any order
        chunk, t0 = blocks.data_chunks[b], 32 * b
        part = torch.empty(2 * dims["nlayers"], chunk.ntokens, dims["hidden"], dtype=kv.dtype)
        decode_chunk(tables, chunk, part, t0)
        expected = whole[:, :, t0:t0 + chunk.ntokens]
        assert torch.equal(part.view(2, dims["nlayers"], chunk.ntokens, -1), expected)
    again = CacheGenGPUEncoderOutput.from_bytes(blocks.to_bytes())
    assert torch.equal(decode_kv(again, kv.dtype), whole)


def test_decode_function_gpu_fills_the_output_or_refuses_one_too_short(make_kv, dims) -> None:
    nl, hidden = dims["nlayers"], dims["hidden"]
    kv = make_kv(ntokens=40)
    cfg = CacheGenConfig.default_for_layers(nl)
    blocks = encode_function(kv, cfg, torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins()), 16)
    tables = StreamTables.of(blocks)
    out = torch.zeros(2 * nl, 40, hidden, dtype=kv.dtype)
    decode_function_gpu(tables, blocks.data_chunks, nl, 16, out)
    assert torch.equal(out.view(2, nl, 40, hidden), decode_kv(blocks, kv.dtype))
    short = torch.zeros(2 * nl, 39, hidden, dtype=kv.dtype)
    with pytest.raises(ValueError, match="40 tokens"):
        decode_function_gpu(tables, blocks.data_chunks, nl, 16, short)
    assert not short.any()  # refused before any block is written


def test_the_first_token_of_each_block_is_an_anchor_8x_finer(make_kv, dims) -> None:
    kv = make_kv(ntokens=64)
    cfg = CacheGenConfig.uniform(dims["nlayers"], 16, 16)
    kb, vb = torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins())
    encoded = encode_function(kv, cfg, kb, vb, chunk_size=32)
    assert encoded.anchor_refinements.shape == (2, 2 * dims["nlayers"], dims["hidden"])
    err = (decode_kv(encoded, torch.float32) - kv.float()).abs()
    exps = torch.stack([encoded.max_tensors_key, encoded.max_tensors_value])
    step = torch.from_numpy(steps(exps.numpy()))[..., None]
    rounding = kv.float().abs() * 2.0 ** -8  # of the bf16 input
    for t in (0, 32):  # anchors: within a sixteenth of a step
        assert bool((err[:, :, t] <= step[:, :, t] / 16 + rounding[:, :, t] + 1e-6).all())
    assert float((err / step)[:, :, 1:32].max()) > 0.25  # the others: half a step


def test_stream_records_bins_and_head_split(serde, make_kv, stream_of, dims) -> None:
    ser, _ = serde
    out = stream_of(ser.to_bytes(make_kv(ntokens=8)))
    assert out.num_heads == dims["heads"] and out.head_size == dims["head_size"]
    assert out.key_bins.tolist() == ser.cachegen_config.key_bins()
    assert out.value_bins.tolist() == ser.cachegen_config.value_bins()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nlayers=st.integers(1, 3), ntokens=st.integers(1, 40), hidden=st.integers(1, 24),
       bins=st.integers(2, 200), scale=st.floats(1e-3, 1e3),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       seed=st.integers(0, 2**16))
@example(nlayers=1, ntokens=1, hidden=24, bins=2, scale=875.0, dtype=torch.float16, seed=373)
def test_hypothesis_random_shapes_roundtrip(make_kv, within_half_step, nlayers: int, ntokens: int,
                                            hidden: int, bins: int, scale: float,
                                            dtype: torch.dtype, seed: int) -> None:
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=64)
    md = LMCacheEngineMetadata("random", 1, 0, "vllm", dtype, (nlayers, 2, 64, 1, hidden))
    ser = CacheGenSerializer(cfg, md, cachegen_config=CacheGenConfig.uniform(nlayers, bins, bins))
    kv = (make_kv(nlayers, ntokens, hidden, torch.float32, seed) * scale).to(dtype)
    if not kv.isfinite().all():  # large scales overflow fp16: refused, not stored
        with pytest.raises(ValueError, match="non-finite"):
            ser.to_bytes(kv)
        return
    data = ser.to_bytes(kv)
    out = CacheGenDeserializer(cfg, md, dtype).from_bytes(data)
    assert out.shape == kv.shape and out.dtype == dtype
    within_half_step(kv, out, data)


@pytest.mark.parametrize("use_native", [True, False])
def test_decoding_into_a_buffer_of_the_wrong_size_is_refused_and_writes_nothing(make_kv, dims,
                                                                                 use_native: bool
                                                                                 ) -> None:
    """`out` a contiguous prefix of a larger tensor: the native decoder wrote past its end."""
    kv = make_kv(ntokens=40)
    bins = torch.full((dims["nlayers"],), 32)
    stream = encode_stream(kv, bins, bins, 64)
    memory = torch.zeros(2 * kv.numel(), dtype=kv.dtype)
    for size in (kv.numel() // 2, kv.numel() + 1):
        with pytest.raises(ValueError, match="out"):
            decode_stream(stream, kv.dtype, kernels(use_native), out=memory[:size])
        assert int(memory.count_nonzero()) == 0
    decode_stream(stream, kv.dtype, kernels(use_native), out=memory[:kv.numel()].view(kv.shape))
    assert torch.equal(memory[:kv.numel()].view(kv.shape), decode_stream(stream, kv.dtype))
