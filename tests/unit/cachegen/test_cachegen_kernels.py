"""The native kernels give bit-identical streams and values to the numpy reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lmcache.cachegen.config import CacheGenConfig
from lmcache.cachegen.decoder import decode_stream
from lmcache.cachegen.encoder import encode_stream
from lmcache.cachegen.kernels import NativeKernels, ReferenceKernels, kernels
from lmcache.storage_backend.serde.serde import CorruptBlobError
from tests.helpers.copy_paths import NATIVE_PATHS

NATIVE = kernels()
pytestmark = pytest.mark.skipif(not isinstance(NATIVE, NativeKernels),
                                reason="native kernels unavailable (no C compiler)")
REFERENCE = ReferenceKernels()


@pytest.fixture(params=NATIVE_PATHS)
def native(request) -> NativeKernels:
    """The native kernels in their build for each vector path this CPU runs."""
    coder = kernels(isa=request.param)
    assert isinstance(coder, NativeKernels)
    if coder.path != request.param:
        pytest.skip(f"no {request.param} build of CacheGen's kernels (their {coder.path} one serves it)")
    return coder


def test_lmcache_native_0_selects_the_reference(monkeypatch) -> None:
    from lmcache import native

    assert isinstance(kernels(use_native=False), ReferenceKernels)
    monkeypatch.setenv("LMCACHE_NATIVE", "0")
    monkeypatch.setattr(native, "_loaded", {})  # as in a fresh process
    assert isinstance(kernels(), ReferenceKernels)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nlayers=st.integers(1, 3), ntokens=st.integers(1, 70), hidden=st.integers(1, 40),
       chunk=st.integers(1, 80), bins=st.integers(2, 300), scale=st.floats(1e-3, 1e3),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       seed=st.integers(0, 2**16))
@example(nlayers=1, ntokens=1, hidden=31, chunk=1, bins=2, scale=875.0, dtype=torch.float16, seed=300)
def test_native_and_reference_streams_and_values_are_identical(
        make_kv, native: NativeKernels, nlayers: int, ntokens: int, hidden: int, chunk: int, bins: int,
        scale: float, dtype: torch.dtype, seed: int) -> None:
    kv = (make_kv(nlayers, ntokens, hidden, torch.float32, seed) * scale).to(dtype)
    cfg = CacheGenConfig.uniform(nlayers, bins, max(2, bins // 2))
    kb, vb = torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins())
    if not kv.isfinite().all():  # large scales overflow fp16: both refuse, with the same message
        for coder in (native, REFERENCE):
            with pytest.raises(ValueError, match="non-finite"):
                encode_stream(kv, kb, vb, chunk, coder)
        return
    coded, reference = encode_stream(kv, kb, vb, chunk, native), encode_stream(kv, kb, vb, chunk, REFERENCE)
    assert coded.to_bytes() == reference.to_bytes()
    _assert_fused_equals_passes(native, kv, kb, vb,
                                [min(chunk, ntokens - t) for t in range(0, ntokens, chunk)])
    for out_dtype in (dtype, torch.float32):
        a, b = decode_stream(coded, out_dtype, native), decode_stream(coded, out_dtype, REFERENCE)
        assert a.dtype == out_dtype and torch.equal(a, b)


def _assert_fused_equals_passes(native: NativeKernels, kv: torch.Tensor, kb: torch.Tensor,
                                vb: torch.Tensor, blocks: list[int]) -> None:
    """The native fused encoder gives the native passes' results, field by field."""
    import numpy as np

    from lmcache.cachegen.encoder import CacheGenEncoderImpl

    def impl() -> CacheGenEncoderImpl:
        return CacheGenEncoderImpl(kv=kv, key_bins=kb, value_bins=vb, block_tokens=blocks,
                                   kernels=native)

    fused, passes = impl().code(), impl().code_by_passes()
    for name in ("means", "exps", "refine", "classes", "low", "size", "freqs"):
        a, b = getattr(fused, name), getattr(passes, name)
        assert a.shape == b.shape and np.array_equal(a, b), name
    assert fused.encoded.payload == passes.encoded.payload
    assert fused.encoded.lengths.tolist() == passes.encoded.lengths.tolist()


@pytest.mark.parametrize("kind", ["zeros", "constant", "one channel", "tiny values"])
def test_degenerate_kv_codes_as_the_reference_does(native: NativeKernels, kind: str) -> None:
    """No coded channel at all (every group a single symbol), one channel, subnormal values."""
    kv = {"zeros": torch.zeros(2, 2, 10, 8), "constant": torch.full((2, 2, 10, 8), 3.0),
          "one channel": torch.randn(2, 1, 33, 1, generator=torch.Generator().manual_seed(0)),
          "tiny values": torch.randn(2, 2, 20, 8, generator=torch.Generator().manual_seed(1)) * 1e-40
          }[kind]
    kb, vb = torch.full((kv.shape[1],), 20), torch.full((kv.shape[1],), 10)
    coded, reference = encode_stream(kv, kb, vb, 7, native), encode_stream(kv, kb, vb, 7, REFERENCE)
    assert coded.to_bytes() == reference.to_bytes()
    assert torch.equal(decode_stream(coded, torch.float32, native),
                       decode_stream(coded, torch.float32, REFERENCE))


def test_a_block_of_more_than_65535_tokens_codes_as_the_reference_does(native: NativeKernels) -> None:
    """The quantizer flushes its 32-bit per-channel sums of |q| every 65,536 tokens."""
    kv = torch.randn(2, 1, 70_000, 4, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    kb = vb = torch.tensor([300])
    coded = encode_stream(kv, kb, vb, 70_000, native)
    assert coded.to_bytes() == encode_stream(kv, kb, vb, 70_000, REFERENCE).to_bytes()
    _assert_fused_equals_passes(native, kv, kb, vb, [70_000])


def test_a_token_whose_symbols_need_a_larger_step_is_coded_by_the_passes(make_kv, native: NativeKernels
                                                                           ) -> None:
    """The fused encoder declines a chunk where a token's step must be raised (a token far
    smaller than its channels' means); the passes code it, still as the reference does."""
    import numpy as np

    kv = make_kv(2, 40, 32, torch.float32) + 30.0  # channel means ~30 ...
    kv[:, :, 7] *= 1e-6  # ... token 7 near 0: its RMS step would make |q| ~ 30 / 1e-6
    cfg = CacheGenConfig.default_for_layers(2)
    kb, vb = torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins())
    x = kv.reshape(4, 40, 32).contiguous()
    bins = np.concatenate([cfg.key_bins(), cfg.value_bins()])
    assert native.encode_chunk(x, bins, np.array([0, 40])) is None
    coded, reference = encode_stream(kv, kb, vb, 40, native), encode_stream(kv, kb, vb, 40, REFERENCE)
    assert coded.to_bytes() == reference.to_bytes()
    step = 2.0 ** (coded.max_tensors_key[:, 7].float() / 8)  # token 7's raised step, per layer
    error = (decode_stream(coded, torch.float32, native)[0, :, 7] - kv[0, :, 7]).abs().amax(1)
    assert (error <= step / 2 * (1 + 1e-4)).all()


def test_the_serializer_writes_the_stream_encode_stream_gives(make_kv) -> None:
    """`CacheGenSerializer` packs the coder's arrays directly: the same bytes as packing
    `encode_stream`'s output."""
    from lmcache.cachegen.serde import CacheGenSerializer
    from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
    from lmcache.storage_backend.serde import blob

    kv = make_kv(3, 50, 2 * 8)
    md = LMCacheEngineMetadata("m", 1, 0, "vllm", torch.bfloat16, (3, 2, 64, 2, 8))
    for coder in (NATIVE, REFERENCE):
        ser = CacheGenSerializer(LMCacheEngineConfig.from_defaults(chunk_size=64), md, coder=coder)
        out = encode_stream(kv, ser.key_bins, ser.value_bins, 50, coder)
        out.num_heads, out.head_size = 2, 8
        assert blob.unpack(ser.to_bytes(kv), "cachegen").payload == out.to_bytes()


def test_pairs_with_and_without_single_symbol_channels_code_identically(make_kv, native: NativeKernels
                                                                         ) -> None:
    """The native coder reads the symbols of a pair whose channels are all coded directly and
    those of a pair with single-symbol (uncoded) channels through its channel list: both must
    give the reference's stream."""
    from lmcache.cachegen.encoder import CacheGenEncoderImpl

    kv = make_kv(2, 96, 64)
    kv[0, 1, :, 5:9] = kv[0, 1, 0, 5:9]  # K of layer 1: four channels constant over the tokens
    cfg = CacheGenConfig.default_for_layers(2)
    kb, vb = torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins())
    layout = CacheGenEncoderImpl(kv=kv, key_bins=kb, value_bins=vb).compute_cdf().layout
    assert layout.ncoded[1] < 64 and (layout.ncoded[[0, 2, 3]] == 64).all()
    coded, reference = encode_stream(kv, kb, vb, 48, native), encode_stream(kv, kb, vb, 48, REFERENCE)
    assert coded.to_bytes() == reference.to_bytes()
    assert torch.equal(decode_stream(coded, torch.bfloat16, native),
                       decode_stream(coded, torch.bfloat16, REFERENCE))


def test_the_native_decoder_checks_its_tables_itself(make_kv, native: NativeKernels) -> None:
    """Frequency tables that do not sum to the scale never reach the native decoder through the
    stream parser; called directly with such tables it reports corrupt substreams (it must not
    write its slot tables out of bounds)."""
    from lmcache.cachegen.decoder import StreamTables

    cfg = CacheGenConfig.default_for_layers(2)
    encoded = encode_stream(make_kv(2, 32, 16), torch.tensor(cfg.key_bins()),
                            torch.tensor(cfg.value_bins()), 32)
    tables = StreamTables.of(encoded)
    lengths = encoded.start_indices.long().diff(dim=1).reshape(-1).numpy()
    for bad in (tables.freq * 2, tables.freq // 2):
        with pytest.raises(CorruptBlobError, match="do not decode"):
            native.decode(encoded.bytestream, lengths, tables.layout, bad, tables.means, tables.steps,
                          tables.refine, 32, torch.bfloat16)


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_the_coded_words_decode_in_place_at_any_byte_offset(make_kv, native: NativeKernels,
                                                             offset: int) -> None:
    """A blob's substreams start wherever its tables end: the decoder reads them there, aligned
    or not, with the same result."""
    cfg = CacheGenConfig.default_for_layers(2)
    encoded = encode_stream(make_kv(2, 48, 24), torch.tensor(cfg.key_bins()),
                            torch.tensor(cfg.value_bins()), 16)
    expected = decode_stream(encoded, torch.bfloat16, REFERENCE)
    shifted = bytearray(offset) + bytes(encoded.bytestream)
    encoded.bytestream = memoryview(shifted)[offset:]
    assert torch.equal(decode_stream(encoded, torch.bfloat16, native), expected)


@pytest.mark.parametrize("coder", [NATIVE, REFERENCE], ids=["native", "reference"])
def test_each_coder_rejects_a_changed_substream_word(make_kv, coder) -> None:
    cfg = CacheGenConfig.default_for_layers(2)
    kv = make_kv(2, 48, 16)
    encoded = encode_stream(kv, torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins()), 16)
    data = bytearray(encoded.bytestream)
    data[len(data) // 3] ^= 0x10
    encoded.bytestream = bytes(data)
    with pytest.raises(CorruptBlobError, match=r"substream|decode"):
        decode_stream(encoded, torch.bfloat16, coder)


def test_threads_encoding_and_decoding_at_once_get_the_single_thread_results(make_kv) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cfg = CacheGenConfig.default_for_layers(3)
    kb, vb = torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins())
    inputs = [make_kv(3, 64, 48, seed=s) for s in range(8)]
    expected = [encode_stream(kv, kb, vb, 32, NATIVE).to_bytes() for kv in inputs]

    def roundtrip(i: int) -> tuple[bytes, torch.Tensor]:
        encoded = encode_stream(inputs[i], kb, vb, 32, NATIVE)
        junk = [bytearray(4096 * (1 + i % 5)) for _ in range(50)]  # churn the allocator
        del junk
        return encoded.to_bytes(), decode_stream(encoded, torch.bfloat16, NATIVE)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(roundtrip, [i % 8 for i in range(32)]))
    for i, (data, kv) in enumerate(results):
        assert data == expected[i % 8]
        assert torch.equal(kv, decode_stream(encode_stream(inputs[i % 8], kb, vb, 32, NATIVE),
                                             torch.bfloat16, NATIVE))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(npairs=st.integers(1, 5), nch=st.integers(1, 40), ntok=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_native_group_tables_equal_the_reference(native: NativeKernels, npairs: int, nch: int, ntok: int,
                                                  seed: int) -> None:
    """Groups, layout (pairs with single-symbol channels included) and frequency tables."""
    import numpy as np

    rng = np.random.default_rng(seed)
    q = rng.integers(-3, 4, (npairs, ntok, nch)).astype(np.int16)
    q[:, :, rng.random(nch) < 0.3] = rng.integers(-3, 4)  # constant channels: one-symbol groups
    classes = rng.integers(0, 16, (npairs, nch)).astype(np.uint8)
    classes[:, rng.random(nch) < 0.5] = 0  # channels sharing groups
    qmin, qmax = q.min(axis=1).astype(np.int32), q.max(axis=1).astype(np.int32)
    low, size = native.group_ranges(classes, qmin, qmax)
    ref_low, ref_size = REFERENCE.group_ranges(classes, qmin, qmax)
    assert low.tolist() == ref_low.tolist() and size.tolist() == ref_size.tolist()
    starts = np.array([0, ntok])
    layout = native.layout(classes, low, size, starts)
    ref_layout = REFERENCE.layout(classes, low, size, starts)
    for name in ("group_of", "group_low", "group_size", "group_start", "ncoded", "chans", "nconst",
                 "cchans", "sym_base"):
        assert getattr(layout, name).tolist() == getattr(ref_layout, name).tolist(), name
    counts = REFERENCE.histogram(q, layout)
    assert native.normalize(counts, layout).tolist() == REFERENCE.normalize(counts, layout).tolist()


def test_native_layout_rejects_ranges_that_do_not_match_the_classes() -> None:
    import numpy as np

    classes = np.array([[0, 3, 3]], np.uint8)  # two groups
    for low, size in ((np.array([0]), np.array([2])), (np.array([0, 0, 0]), np.array([2, 2, 2]))):
        for coder in (NATIVE, REFERENCE):
            with pytest.raises(ValueError):
                coder.layout(classes, low, size, np.array([0, 4]))
    with pytest.raises(ValueError):
        NATIVE.layout(np.array([[16]], np.uint8), np.array([0]), np.array([2]), np.array([0, 4]))


@pytest.mark.parametrize("setting, expected", [("1", "True"), ("0", "False")])
def test_malloc_tuning_is_applied_once_per_process_unless_turned_off(setting: str, expected: str) -> None:
    """glibc keeps the memory an encode frees for the next (see `native.tune_malloc`); a fresh
    process, as the setting is process-wide."""
    import os
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt thresholds are glibc's")
    code = "from lmcache import native; print(native.tune_malloc(), native.tune_malloc())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LMCACHE_MALLOC_TUNING": setting}, check=True)
    assert out.stdout.split() == [expected, expected]
