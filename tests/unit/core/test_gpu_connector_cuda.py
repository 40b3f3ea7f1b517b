"""The staged CUDA path (runs only where CUDA is present): bit-exact for every layout and both row
kernels, asynchronous with the documented ordering (a store's gather before the caller's later
work, a retrieve's scatter before the caller's later work, `on_done` once the DMAs completed), a
bounded staging ring reused across requests, and one engine round trip."""

import threading

import pytest
import torch

from tests.helpers.paged_kv import LAYOUTS, KVCache, build_engine, chunk_objects, request_ranges

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

L, H, D, BS, NB = 4, 4, 64, 16, 64
CHUNK = 64
CHUNK_BYTES = 2 * L * CHUNK * H * D * 2
KERNELS = ("triton", "torch")


def cache(layout, **kw):
    return KVCache(layout, layers=L, heads=H, head_size=D, block_size=BS, num_blocks=NB, device="cuda",
                   **kw)


def big_cache(layout):
    """8 layers x 8 heads x 128 over 8,192 slots: a 256 MiB request takes milliseconds to move, so
    a missing stream dependency would show as a race."""
    return KVCache(layout, layers=8, heads=8, head_size=128, block_size=16, num_blocks=512, device="cuda")


class Done:
    """An `on_done` recording its calls and the thread they came from."""

    def __init__(self):
        self.calls, self.threads, self.event = [], [], threading.Event()

    def __call__(self, error):
        self.calls.append(error)
        self.threads.append(threading.current_thread().name)
        self.event.set()

    def wait(self):
        assert self.event.wait(30), "on_done never ran"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_round_trips_bit_exact_with_both_kernels(layout, gaps, kernel):
    src = cache(layout)
    conn = src.connector(staged_kernel=kernel, piece_bytes=2 * CHUNK_BYTES,
                         staging_bytes=2 * CHUNK_BYTES)
    assert conn.staged_copier(torch.device("cuda", torch.cuda.current_device())).kernel == kernel
    sizes = [CHUNK] * 5 + [37]
    starts, ends = request_ranges(sizes)
    slots = src.slots_for(ends[-1])
    objs = chunk_objects(conn, sizes, gaps)
    stored = Done()
    conn.batched_from_gpu(objs, starts, ends, on_done=stored, **src.kwargs(slots.cuda()))
    stored.wait()
    assert stored.calls == [None]
    for obj, a, b in zip(objs, starts, ends):
        assert torch.equal(obj.tensor, src.rows(slots[a:b]))
    dst = src.zeros_like()
    skip = slots.clone()
    if src.paged:
        skip[:5] = -1  # tokens the engine already holds: left untouched
    conn.batched_to_gpu(objs, starts, ends, **dst.kwargs(skip))  # on_done=None: waits
    written = torch.zeros(src.num_slots, dtype=torch.bool)
    written[skip[skip >= 0]] = True
    assert torch.equal(dst.all_rows()[:, :, written], src.all_rows()[:, :, written])
    assert not dst.all_rows()[:, :, ~written].any()
    assert conn.staged_copier(torch.device("cuda", torch.cuda.current_device())).kernel == kernel


@pytest.mark.parametrize("layout", ["flash_attn", "hf"])
def test_cuda_blobs_equal_the_cpu_native_path(layout):
    src = cache(layout)
    cpu = KVCache(layout, layers=L, heads=H, head_size=D, block_size=BS, num_blocks=NB)
    cpu.kvcaches = [t.cpu() if isinstance(t, torch.Tensor) else tuple(x.cpu() for x in t)
                    for t in src.kvcaches]
    sizes = [CHUNK] * 3
    starts, ends = request_ranges(sizes)
    slots = src.slots_for(ends[-1])
    out = []
    for kv, conn in ((src, src.connector()), (cpu, cpu.connector())):
        objs = chunk_objects(conn, sizes)
        conn.batched_from_gpu(objs, starts, ends, **kv.kwargs(slots))
        out.append(torch.cat([o.tensor.flatten() for o in objs]))
    assert torch.equal(out[0], out[1])


def test_a_store_returns_once_issued_and_the_callers_stream_waits_for_the_gather():
    src = big_cache("flash_attn")
    conn = src.connector(piece_bytes=16 << 20)
    sizes = [256] * 32
    starts, ends = request_ranges(sizes)
    slots = src.slots_for(ends[-1])
    expected = [src.rows(slots[a:b]) for a, b in zip(starts, ends)]
    objs = chunk_objects(conn, sizes)
    done = Done()
    conn.batched_from_gpu(objs, starts, ends, on_done=done, **src.kwargs(slots))
    for t in src.kvcaches:  # the caller's next work on its stream: must not race the gather
        t.zero_()
    done.wait()
    assert done.calls == [None] and done.threads[0].startswith("lmcache-kv-copies")
    assert all(torch.equal(o.tensor, e) for o, e in zip(objs, expected))


def test_a_retrieve_orders_the_callers_stream_after_the_scatter_without_host_sync():
    src = big_cache("flashinfer")
    conn = src.connector(piece_bytes=16 << 20)
    sizes = [256] * 32
    starts, ends = request_ranges(sizes)
    slots = src.slots_for(ends[-1])
    objs = chunk_objects(conn, sizes)
    conn.batched_from_gpu(objs, starts, ends, **src.kwargs(slots))
    dst = src.zeros_like()
    done = Done()
    conn.batched_to_gpu(objs, starts, ends, on_done=done, **dst.kwargs(slots))
    snapshot = [t.clone() for t in dst.kvcaches]  # on the caller's stream, no synchronisation
    done.wait()
    assert done.calls == [None]
    dst.kvcaches = snapshot
    assert torch.equal(dst.rows(slots), src.rows(slots))


def test_single_object_calls_return_with_the_copy_complete():
    src = cache("kv_tuples")
    conn = src.connector()
    slots = src.slots_for(CHUNK)
    (obj,) = chunk_objects(conn, [CHUNK])
    conn.from_gpu(obj, 0, CHUNK, **src.kwargs(slots))
    assert torch.equal(obj.tensor, src.rows(slots))
    dst = src.zeros_like()
    conn.to_gpu(obj, 0, CHUNK, **dst.kwargs(slots))
    assert torch.equal(dst.rows(slots), src.rows(slots))


def test_back_to_back_requests_share_a_bounded_staging_ring():
    src = cache("flash_attn")
    conn = src.connector(piece_bytes=CHUNK_BYTES, staging_bytes=2 * CHUNK_BYTES)
    pending = []
    for _ in range(6):
        sizes = [CHUNK] * 3
        starts, ends = request_ranges(sizes)
        slots = src.slots_for(ends[-1])
        objs = chunk_objects(conn, sizes)
        done = Done()
        conn.batched_from_gpu(objs, starts, ends, on_done=done, **src.kwargs(slots))
        pending.append((objs, slots, starts, ends, done))
    assert conn.drain(30)
    for objs, slots, starts, ends, done in pending:
        assert done.calls == [None]
        assert all(torch.equal(o.tensor, src.rows(slots[a:b])) for o, a, b in zip(objs, starts, ends))
    copier = conn.staged_copier(torch.device("cuda", torch.cuda.current_device()))
    assert copier.staging[0] == 2


def test_engine_store_and_retrieve_on_cuda():
    src = cache("flash_attn")
    conn = src.connector()
    engine = build_engine(CHUNK, L, H, D, cpu_bytes=16 << 20, connector=conn)
    tokens = torch.randint(0, 1000, (5 * CHUNK + 7,))
    slots = src.slots_for(tokens.numel())
    engine.store(tokens, **src.kwargs(slots.cuda()))
    assert conn.drain(30)
    assert engine.lookup(tokens) == tokens.numel()
    dst = src.zeros_like()
    assert bool(engine.retrieve(tokens, **dst.kwargs(slots)).all())
    assert torch.equal(dst.rows(slots), src.rows(slots))
    engine.close()
    assert engine.memory_allocator.used_bytes == 0
