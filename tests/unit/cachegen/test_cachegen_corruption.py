"""Corrupt, truncated or foreign bytes raise CorruptBlobError (a ValueError), never garbage."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from lmcache.cachegen import format as fmt
from lmcache.cachegen import gpu
from lmcache.cachegen import serde as cachegen_serde
from lmcache.cachegen.serde import CacheGenSerializer
from lmcache.config import LMCacheEngineMetadata
from lmcache.observability import forget_logged_once
from lmcache.storage_backend.serde import blob
from lmcache.storage_backend.serde.serde import CorruptBlobError, ForeignSerdeError


@pytest.fixture
def good(serde, make_kv) -> bytes:
    return serde[0].to_bytes(make_kv(ntokens=40))


def rewrap(data: bytes, payload: bytes) -> bytes:
    """`payload` under a valid blob header (same shape/dtype): only the cachegen checks remain."""
    head = blob.unpack(data, "cachegen")
    return blob.pack_header("cachegen", head.shape, head.dtype, payload) + payload


def test_corrupt_blob_error_is_a_value_error() -> None:
    assert issubclass(CorruptBlobError, ValueError)


@pytest.mark.parametrize("cut", [0, 10, blob.HEADER_SIZE, blob.HEADER_SIZE + 30, -1, -100])
def test_truncated_blobs_are_rejected(serde, good: bytes, cut: int) -> None:
    with pytest.raises(CorruptBlobError):
        serde[1].from_bytes(good[:cut])


@pytest.mark.parametrize("pos", [0, 5, 40, blob.HEADER_SIZE + 3, blob.HEADER_SIZE + 500, -7])
def test_flipped_bytes_are_rejected(serde, good: bytes, pos: int) -> None:
    bad = bytearray(good)
    bad[pos] ^= 0x5A
    with pytest.raises(CorruptBlobError):
        serde[1].from_bytes(bytes(bad))


def test_a_blob_of_another_serde_is_rejected(serde, good: bytes) -> None:
    payload = bytes(blob.unpack(good).payload)
    foreign = blob.pack_header("naive", (2, 4, 40, 32), blob.unpack(good).dtype, payload) + payload
    with pytest.raises(CorruptBlobError, match="serde id"):
        serde[1].from_bytes(foreign)


def test_stream_truncated_under_a_valid_header_is_rejected(serde, good: bytes) -> None:
    payload = bytes(blob.unpack(good).payload)
    for cut in (3, 30, 200, len(payload) // 2, len(payload) - 4):
        with pytest.raises(CorruptBlobError, match="cachegen"):
            serde[1].from_bytes(rewrap(good, payload[:cut]))


def test_wrong_magic_and_version_are_rejected(serde, good: bytes) -> None:
    payload = bytearray(blob.unpack(good).payload)
    payload[:4] = b"XXXX"
    with pytest.raises(CorruptBlobError, match="bad magic"):
        serde[1].from_bytes(rewrap(good, bytes(payload)))
    payload = bytearray(blob.unpack(good).payload)
    payload[4] = fmt.VERSION + 1
    with pytest.raises(CorruptBlobError, match="version"):
        serde[1].from_bytes(rewrap(good, bytes(payload)))


def test_a_stream_of_the_previous_format_version_is_a_logged_stale_miss(serde, good: bytes,
                                                                         caplog) -> None:
    payload = bytearray(blob.unpack(good).payload)
    payload[4] = 1  # format version 1: constriction's coder, before rANS
    cachegen_serde.logger.propagate = True
    forget_logged_once()
    with caplog.at_level(logging.WARNING, logger=cachegen_serde.logger.name):
        for _ in range(3):
            with pytest.raises(fmt.StaleStreamError, match="version 1"):
                serde[1].from_bytes(rewrap(good, bytes(payload)))
    assert sum("version 1" in r.getMessage() for r in caplog.records) == 1


def test_an_unknown_coder_id_is_rejected(serde, good: bytes) -> None:
    payload = bytearray(blob.unpack(good).payload)
    payload[5] = 9
    with pytest.raises(CorruptBlobError, match="coder id 9"):
        serde[1].from_bytes(rewrap(good, bytes(payload)))


def test_inconsistent_header_fields_are_rejected(serde, good: bytes) -> None:
    payload = bytes(blob.unpack(good).payload)
    fields = list(fmt._HEAD.unpack_from(payload))
    for index, value, message in [(6, 0, "bad cachegen dims"), (7, 2, "do not add up"),
                                  (8, 1, "symbol groups"), (6, 41, "do not add up")]:
        changed = list(fields)
        changed[index] = value
        bad = fmt._HEAD.pack(*changed) + payload[fmt._HEAD.size:]
        with pytest.raises(CorruptBlobError, match=message):
            serde[1].from_bytes(rewrap(good, bad))


def test_stream_shape_must_match_the_blob_header(serde, good: bytes) -> None:
    head = blob.unpack(good)
    payload = bytes(head.payload)
    other = blob.pack_header("cachegen", (2, 4, 41, 32), head.dtype, payload) + payload
    with pytest.raises(CorruptBlobError, match="shape"):
        serde[1].from_bytes(other)


def test_a_frequency_table_not_summing_to_the_scale_is_rejected(serde, good: bytes, stream_of) -> None:
    out = stream_of(good)
    out.cdf[: int(out.symbol_ranges[0, 1])] = 0
    with pytest.raises(CorruptBlobError, match="do not sum"):
        serde[1].from_bytes(rewrap(good, out.to_bytes()))


def test_a_symbol_group_past_the_16_bit_range_is_rejected(serde, good: bytes, stream_of) -> None:
    out = stream_of(good)
    out.symbol_ranges[0, 0] = 32767 - int(out.symbol_ranges[0, 1]) + 2  # its top symbol is 32768
    with pytest.raises(CorruptBlobError, match="16-bit"):
        serde[1].from_bytes(rewrap(good, out.to_bytes()))
    out.symbol_ranges[0, 0] -= 1  # top symbol 32767: parses (and decodes to garbage, not a crash)
    serde[1].from_bytes(rewrap(good, out.to_bytes()))


def test_substream_missing_its_last_word_is_rejected(serde, good: bytes, stream_of) -> None:
    out = stream_of(good)
    lengths = np.diff(out.start_indices.numpy(), axis=1)[0]
    g = int(np.flatnonzero(lengths >= 8)[0])
    start = int(out.start_indices[0, g])
    end = start + int(lengths[g])
    out.bytestream = out.bytestream[: end - 4] + out.bytestream[end:]
    out.start_indices[0, g + 1:] -= 4
    with pytest.raises(CorruptBlobError, match="substream"):
        serde[1].from_bytes(rewrap(good, out.to_bytes()))


def test_bytes_beyond_the_substreams_are_rejected(serde, good: bytes) -> None:
    payload = bytes(blob.unpack(good).payload) + b"\x00\x00\x00\x00"
    with pytest.raises(CorruptBlobError, match="payload has"):
        serde[1].from_bytes(rewrap(good, payload))


def test_substream_lengths_must_be_whole_words(serde, good: bytes, stream_of) -> None:
    out = stream_of(good)
    out.bytestream += b"\x00"
    out.start_indices[-1, -1] += 1
    with pytest.raises(CorruptBlobError, match="whole 32-bit words"):
        serde[1].from_bytes(rewrap(good, out.to_bytes()))


def gpu_coded(good: bytes, stream_of) -> bytes:
    """`good` re-written as an nvCOMP-coded stream of the same KV shape (payload: filler bytes)."""
    out = stream_of(good)
    out.coder = fmt.CODER_NVCOMP
    out.bytestream = bytes(range(64))
    out.start_indices = torch.tensor([[0, 64]])
    out.symbol_ranges = torch.empty(0, 2, dtype=torch.int32)
    return rewrap(good, out.to_bytes())


@pytest.mark.skipif(gpu.available(), reason="CUDA and nvCOMP present: the stream would be decoded")
def test_a_gpu_coded_stream_without_cuda_is_a_kept_miss_logged_once(serde, good: bytes, stream_of,
                                                                    caplog) -> None:
    data = gpu_coded(good, stream_of)
    cachegen_serde.logger.propagate = True
    forget_logged_once()
    with caplog.at_level(logging.WARNING, logger=cachegen_serde.logger.name):
        for _ in range(3):
            with pytest.raises(fmt.UnavailableCoderError, match="nvCOMP") as info:
                serde[1].from_bytes(data)
            assert isinstance(info.value, ForeignSerdeError)  # tiers keep it for GPU readers
    assert sum("nvCOMP" in r.getMessage() for r in caplog.records) == 1


def test_a_gpu_coded_stream_with_symbol_groups_is_rejected(serde, good: bytes, stream_of) -> None:
    payload = bytearray(blob.unpack(gpu_coded(good, stream_of)).payload)
    fields = list(fmt._HEAD.unpack_from(payload))
    fields[8] = 3
    with pytest.raises(CorruptBlobError, match="no symbol groups"):
        serde[1].from_bytes(rewrap(good, fmt._HEAD.pack(*fields) + payload[fmt._HEAD.size:]))


# ---- well-formed streams whose contents no encoder writes (a buggy or hostile writer) ---------


def test_step_exponents_outside_the_encoders_range_are_rejected(serde, good: bytes, stream_of) -> None:
    """Exponents past quant.EXP_LIMIT make steps of 2**4000: the KV would decode to inf/NaN."""
    out = stream_of(good)
    out.max_tensors_value[1] = 32000
    with pytest.raises(CorruptBlobError, match="step exponent"):
        serde[1].from_bytes(rewrap(good, out.to_bytes()))


def test_non_finite_channel_means_are_rejected(serde, good: bytes, stream_of) -> None:
    out = stream_of(good)
    out.channel_means[0, 2, 5] = float("nan")
    with pytest.raises(CorruptBlobError, match="channel means"):
        serde[1].from_bytes(rewrap(good, out.to_bytes()))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.float8_e4m3fn])
def test_a_blob_header_naming_a_dtype_cachegen_never_writes_is_rejected(serde, good: bytes,
                                                                        dtype: torch.dtype) -> None:
    head = blob.unpack(good, "cachegen")
    payload = bytes(head.payload)
    bad = blob.pack_header("cachegen", head.shape, dtype, payload) + payload
    with pytest.raises(CorruptBlobError, match="dtype"):
        serde[1].from_bytes(bad)


def test_a_stream_of_another_layer_count_is_rejected(engine_config, metadata, serde, make_kv,
                                                     dims) -> None:
    """The stream of a 2-layer model under this 4-layer engine's key would hand it KV of the
    wrong shape."""
    other = LMCacheEngineMetadata("test-model", 1, 0, "vllm", torch.bfloat16,
                                  (2, 2, dims["chunk"], dims["heads"], dims["head_size"]))
    data = CacheGenSerializer(engine_config, other).to_bytes(make_kv(nlayers=2, ntokens=8))
    with pytest.raises(CorruptBlobError, match="layers"):
        serde[1].from_bytes(data)


def test_a_small_stream_claiming_a_huge_chunk_is_rejected_before_allocating(serde, dims) -> None:
    """~500 KB that decode to [2, 1, 65536, 65535] bf16 (16 GiB) if believed: every channel has a
    single symbol, so there are no substreams to check the claimed size against."""
    nlayers, ntok, hidden = 1, 1 << 16, 65535
    pairs = 2 * nlayers
    tables = fmt.RansTables(np.zeros((1, pairs, hidden), np.uint8), np.zeros((pairs, hidden), np.uint8),
                            np.zeros(pairs, np.int16), np.ones(pairs, np.uint16),
                            np.full(pairs, 4096, np.uint16), np.zeros(pairs, np.uint32))
    parts = fmt.pack_fields(fmt.CODER_RANS, 1, hidden, np.full(nlayers, 32), np.full(nlayers, 32),
                            np.array([ntok]), np.zeros((pairs, hidden), np.int16),
                            np.zeros((pairs, ntok), np.int32), tables, b"")
    stream = b"".join(parts)
    assert len(stream) < 600_000
    data = blob.pack_header("cachegen", (2, nlayers, ntok, hidden), torch.bfloat16, stream) + stream
    asked: list[tuple[int, ...]] = []

    def allocate(shape, dtype, fmt_):  # type: ignore[no-untyped-def]
        asked.append(tuple(shape))
        return None

    with pytest.raises(CorruptBlobError, match="chunk"):
        serde[1].from_bytes_to(data, allocate)
    assert asked == []


def test_a_blob_of_another_float_dtype_decodes_into_the_engines_dtype(engine_config, metadata,
                                                                      make_kv) -> None:
    """A chunk key names its dtype, so only a foreign or planted blob carries another one; it must
    still come back in the engine's KV dtype (as every other serde converts), not as a memory object
    that the copy into the paged cache refuses on every later hit."""
    from lmcache.cachegen.serde import CacheGenDeserializer
    from lmcache.memory_management import MixedMemoryAllocator

    kv = make_kv(ntokens=40, dtype=torch.float32)
    data = CacheGenSerializer(engine_config, metadata).to_bytes(kv)
    deserializer = CacheGenDeserializer(engine_config, metadata, torch.bfloat16)
    allocator = MixedMemoryAllocator(1 << 20)
    obj = deserializer.from_bytes_to(data, allocator.allocate)
    assert obj is not None and obj.tensor is not None
    assert obj.tensor.dtype == torch.bfloat16
    assert torch.equal(obj.tensor, deserializer.from_bytes(data).to(torch.bfloat16))
