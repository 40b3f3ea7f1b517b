"""The staged copy path (the CUDA pipeline's pieces, staging ring and row kernels) forced onto CPU
tensors: bit-identical to the native path for every layout, with several pieces, a staging ring
that wraps, objects scattered in the arena, and the Triton kernel under Triton's interpreter."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.gpu_connector import paged as paged_module
from lmcache.gpu_connector.spans import ChunkGroup, plan_pieces
from lmcache.gpu_connector.staged import StagedCopier
from lmcache.memory_management import HostMemoryAllocator
from tests.helpers.paged_kv import LAYOUTS, KVCache, build_engine, chunk_objects, request_ranges

L, H, D, BS, NB = 3, 2, 8, 4, 64
CHUNK = 16
CHUNK_BYTES = 2 * L * CHUNK * H * D * 2  # bf16: 3 KiB, a multiple of the 512-byte alignment


def cache(layout, **kw):
    return KVCache(layout, layers=L, heads=H, head_size=D, block_size=BS, num_blocks=NB, **kw)


def chunk_objects_host(conn, sizes, gaps=False):
    return chunk_objects(conn, sizes, gaps, HostMemoryAllocator(1 << 20))


def test_adjacent_objects_are_one_piece_with_one_group_per_run_of_equal_chunks():
    conn = VLLMPagedMemGPUConnectorV2(H * D, L)
    objs = chunk_objects_host(conn, [CHUNK, CHUNK, CHUNK, 5])
    blobs = [o.tensor for o in objs]
    bounds = [0, 16, 32, 48, 53]
    (piece,) = plan_pieces(objs, blobs, bounds)
    assert piece.groups == [ChunkGroup(3, CHUNK, 0, 0), ChunkGroup(1, 5, 3 * CHUNK_BYTES, 48)]
    assert piece.memory.data_ptr() == blobs[0].data_ptr()
    assert piece.nbytes == 3 * CHUNK_BYTES + blobs[3].nbytes
    limited = plan_pieces(objs, blobs, bounds, max_bytes=2 * CHUNK_BYTES)
    assert [p.first_token for p in limited] == [0, 32]
    assert [p.groups for p in limited] == [[ChunkGroup(2, CHUNK, 0, 0)],
                                           [ChunkGroup(1, CHUNK, 0, 32), ChunkGroup(1, 5, CHUNK_BYTES, 48)]]


def test_objects_apart_in_memory_are_separate_pieces():
    conn = VLLMPagedMemGPUConnectorV2(H * D, L)
    objs = chunk_objects_host(conn, [CHUNK, CHUNK], gaps=True)
    pieces = plan_pieces(objs, [o.tensor for o in objs], [0, 16, 32])
    assert [(p.first_token, p.nbytes) for p in pieces] == [(0, CHUNK_BYTES), (16, CHUNK_BYTES)]


def test_a_padded_partial_chunk_ends_its_group():
    conn = VLLMPagedMemGPUConnectorV2(H * D, L)
    objs = chunk_objects_host(conn, [5, 5, CHUNK])  # 5 tokens = 960 bytes, padded to 1024
    (piece,) = plan_pieces(objs, [o.tensor for o in objs], [0, 5, 10, 26])
    assert piece.groups == [ChunkGroup(1, 5, 0, 0), ChunkGroup(1, 5, 1024, 5), ChunkGroup(1, CHUNK, 2048, 10)]


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_path_is_bit_identical_to_the_native_path(layout, gaps):
    """Several pieces (piece limit 2 chunks), a ring of 2 staging slots reused within the request,
    a padded partial chunk, -1 slots on retrieve."""
    src = cache(layout)
    sizes = [CHUNK] * 5 + [5, 7] if not gaps else [CHUNK] * 4 + [9]
    starts, ends = request_ranges(sizes)
    slots = src.slots_for(ends[-1])
    results = []
    for options in ({}, {"staged": True, "piece_bytes": 2 * CHUNK_BYTES, "staging_bytes": 1}):
        conn = src.connector(**options)
        objs = chunk_objects_host(conn, sizes, gaps)
        conn.batched_from_gpu(objs, starts, ends, **src.kwargs(slots))
        stored = [o.tensor.clone() for o in objs]
        dst = src.zeros_like()
        skip = slots.clone()
        if src.paged:
            skip[:3] = -1
        conn.batched_to_gpu(objs, starts, ends, **dst.kwargs(skip))
        results.append((stored, dst.all_rows()))
    (native_objs, native_back), (staged_objs, staged_back) = results
    assert all(torch.equal(a, b) for a, b in zip(native_objs, staged_objs))
    assert torch.equal(native_back, staged_back)
    assert all(torch.equal(o, src.rows(slots[a:b])) for o, a, b in zip(native_objs, starts, ends))


def test_the_staging_ring_is_bounded_and_reused_across_requests():
    src = cache("flash_attn")
    conn = src.connector(staged=True, piece_bytes=CHUNK_BYTES, staging_bytes=3 * CHUNK_BYTES)
    copier = conn.staged_copier(torch.device("cpu"))
    for _ in range(3):
        starts, ends = request_ranges([CHUNK] * 4)
        slots = src.slots_for(ends[-1])
        objs = chunk_objects_host(conn, [CHUNK] * 4)
        conn.batched_from_gpu(objs, starts, ends, **src.kwargs(slots))
        assert all(torch.equal(o.tensor, src.rows(slots[a:b])) for o, a, b in zip(objs, starts, ends))
    assert copier.staging == (3, CHUNK_BYTES)


def test_lmcache_staged_copy_env_forces_the_staged_path(monkeypatch):
    monkeypatch.setenv(paged_module.STAGED_ENV, "1")
    calls = []
    original = StagedCopier.copy
    monkeypatch.setattr(StagedCopier, "copy", lambda self, *a: calls.append(1) or original(self, *a))
    kv = cache("kv_tuples")
    conn = kv.connector()
    assert conn.staged
    slots = kv.slots_for(CHUNK)
    obj = chunk_objects_host(conn, [CHUNK])[0]
    conn.from_gpu(obj, 0, CHUNK, **kv.kwargs(slots))
    assert calls == [1] and torch.equal(obj.tensor, kv.rows(slots))
    monkeypatch.setenv(paged_module.STAGED_ENV, "0")
    assert not kv.connector().staged


def test_an_engine_over_the_staged_path_stores_and_retrieves_what_the_native_one_does():
    src = cache("flash_attn")
    tokens = torch.randint(0, 1000, (5 * CHUNK + 3,))
    slots = src.slots_for(tokens.numel())
    back = []
    for staged in (False, True):
        engine = build_engine(CHUNK, L, H, D, connector=src.connector(staged=staged, piece_bytes=CHUNK_BYTES))
        engine.store(tokens, **src.kwargs(slots))
        dst = src.zeros_like()
        assert bool(engine.retrieve(tokens, **dst.kwargs(slots)).all())
        back.append(dst.all_rows())
        engine.close()
        assert engine.memory_allocator.used_bytes == 0
    assert torch.equal(back[0], back[1])
    assert torch.equal(back[1][:, :, slots], src.rows(slots))


TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from tests.helpers.paged_kv import LAYOUTS, KVCache
    from lmcache.memory_management import HostMemoryAllocator, MemoryFormat

    for layout in LAYOUTS:
        src = KVCache(layout, layers=2, heads=2, head_size=8, block_size=4, num_blocks=16)
        slots = src.slots_for(21)
        skip = slots.clone()
        if src.paged:
            skip[:3] = -1
        out = []
        for options in ({}, {"staged": True, "staged_kernel": "triton", "piece_bytes": 1}):
            conn = src.connector(**options)
            alloc = HostMemoryAllocator(1 << 16)
            objs = [alloc.allocate(conn.get_shape(n), torch.bfloat16, MemoryFormat.KV_BLOB)
                    for n in (8, 8, 5)]
            conn.batched_from_gpu(objs, [0, 8, 16], [8, 16, 21], **src.kwargs(slots))
            dst = src.zeros_like()
            conn.batched_to_gpu(objs, [0, 8, 16], [8, 16, 21], **dst.kwargs(skip))
            out.append((torch.cat([o.tensor.flatten() for o in objs]), dst.all_rows()))
        assert torch.equal(out[0][0], out[1][0]), layout
        assert torch.equal(out[0][1], out[1][1]), layout
        print("ok", layout)
""")


def test_the_triton_kernel_matches_the_native_path_under_the_interpreter():
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [w for layout in LAYOUTS for w in ("ok", layout)]


def test_a_triton_kernel_that_cannot_launch_falls_back_to_torch_ops(caplog):
    """Without TRITON_INTERPRET, Triton cannot launch on CPU tensors: the copy must still be right."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the interpreter can launch on CPU tensors")
    src = cache("flash_attn")
    conn = src.connector(staged=True, staged_kernel="triton")
    copier = conn.staged_copier(torch.device("cpu"))
    assert copier.kernel == "triton"
    slots = src.slots_for(CHUNK)
    obj = chunk_objects_host(conn, [CHUNK])[0]
    conn.from_gpu(obj, 0, CHUNK, **src.kwargs(slots))
    assert torch.equal(obj.tensor, src.rows(slots))
    assert copier.kernel == "torch" and "torch ops from now on" in caplog.text


def test_the_triton_kernel_claims_16_byte_rows_only_where_every_row_start_is_aligned():
    pytest.importorskip("triton")
    from lmcache.gpu_connector import triton_rows
    from lmcache.gpu_connector.sources import KVSources

    base = torch.zeros(2 * 2048 + 1, dtype=torch.bfloat16)
    aligned = [base[i * 2048: (i + 1) * 2048].view(4, 16, 2, 16) for i in range(2)]
    tables = torch.tensor([[0, 1], [0, 32], [512, 512]])
    assert triton_rows.vector_width(KVSources(aligned, 32), tables) == 8
    shifted = [base[1 + i * 2048: 1 + (i + 1) * 2048].view(4, 16, 2, 16) for i in range(2)]
    assert triton_rows.vector_width(KVSources(shifted, 32), tables) == 1  # 2-byte aligned sources
    assert triton_rows.vector_width(KVSources(aligned, 32), tables + 1) == 1  # buffer rows off by one


@pytest.mark.parametrize("heads, tokens", [(1, 64), (8, 8)])
def test_the_triton_kernel_moves_16_byte_vectors_when_rows_are_aligned(heads, tokens):
    """Compiled ahead of time for an H100 (sm_90; Triton's own ptxas, no GPU needed): with
    VEC=8, every bf16 access of the tile is a 16-byte vector, without it 2-byte scalars."""
    triton = pytest.importorskip("triton")
    import re

    from lmcache.gpu_connector import triton_rows

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ahead-of-time compile API")
    names = ["src", "src_offsets", "slots", "buf", "row_offsets", "source_strides", "num_tokens",
             "block_size", "block_stride", "token_stride", "head_stride", "num_heads"]
    types = ["*i16", "*i64", "*i64", "*i16", "*i64", "*i64", "i32", "i32", "i64", "i64", "i64", "i32"]
    signature = {**dict(zip(names, types, strict=True)),
                 **{k: "constexpr" for k in ("SCATTER", "TOKENS", "HEADS", "HEAD_SIZE", "HEAD_DIM", "VEC")}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(11)}  # as Triton specializes them
    stores, scalar_loads = {}, {}
    for vec in (8, 1):
        constexprs = {"SCATTER": False, "TOKENS": tokens, "HEADS": heads, "HEAD_SIZE": 128,
                      "HEAD_DIM": 128, "VEC": vec}
        try:
            kernel = triton.compile(ASTSource(fn=triton_rows._copy_rows_kernel, signature=signature,
                                              constexprs=constexprs, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 32))
        except Exception as e:  # noqa: BLE001 - no ptxas / another Triton API: nothing to check here
            pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
        ptx = kernel.asm["ptx"]
        stores[vec] = set(re.findall(r"st\.global[.\w]*", ptx))
        scalar_loads[vec] = "ld.global.b16" in ptx
    assert stores[8] == {"st.global.v4.b32"} and not scalar_loads[8]
    assert stores[1] == {"st.global.b16"} and scalar_loads[1]  # VEC=1: scalars, right for any alignment
