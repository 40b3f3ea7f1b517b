import random
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.memory_management import (
    BufferAllocator,
    BytesBufferMemoryObj,
    GPUMemoryAllocator,
    HostMemoryAllocator,
    MemoryFormat,
    MixedMemoryAllocator,
    PinMemoryAllocator,
    TensorMemoryAllocator,
)

ALIGN = TensorMemoryAllocator.ALIGN_BYTES


def alloc(size=64 * ALIGN):
    return TensorMemoryAllocator(torch.zeros(size, dtype=torch.uint8))


def test_allocations_are_aligned_and_do_not_overlap():
    a = alloc()
    objs = [a.allocate((n,), torch.uint8) for n in (1, 511, 512, 513, 1000)]
    starts = [o.metadata.address for o in objs]
    assert all(s % ALIGN == 0 for s in starts)
    assert [o.metadata.phy_size for o in objs] == [512, 512, 512, 1024, 1024]
    for o in objs:
        o.tensor.fill_(o.metadata.address % 251)
    for o in objs:
        assert bool((o.tensor == o.metadata.address % 251).all())
    a.check_integrity()


def test_tensor_view_has_shape_and_dtype():
    obj = alloc().allocate((2, 3, 4, 8), torch.bfloat16)
    assert obj.tensor.shape == (2, 3, 4, 8) and obj.tensor.dtype == torch.bfloat16
    assert obj.get_memory_format() == MemoryFormat.KV_BLOB and obj.get_size() == 2 * 3 * 4 * 8 * 2
    assert len(obj.byte_array) == obj.get_size()


def test_returns_none_when_full_and_first_fit_reuses_freed_space():
    a = alloc(4 * ALIGN)
    objs = [a.allocate((ALIGN,), torch.uint8) for _ in range(4)]
    assert a.allocate((1,), torch.uint8) is None
    objs[1].ref_count_down()
    again = a.allocate((ALIGN,), torch.uint8)
    assert again is not None and again.metadata.address == ALIGN
    assert a.allocate((2 * ALIGN,), torch.uint8) is None


def test_free_coalesces_neighbours():
    a = alloc(4 * ALIGN)
    objs = [a.allocate((ALIGN,), torch.uint8) for _ in range(4)]
    for i in (0, 2, 1, 3):
        objs[i].ref_count_down()
        a.check_integrity()
    big = a.allocate((4 * ALIGN,), torch.uint8)
    assert big is not None and big.metadata.address == 0


def test_ref_counting_frees_at_zero_and_rejects_misuse():
    a = alloc(2 * ALIGN)
    obj = a.allocate((ALIGN,), torch.uint8)
    obj.ref_count_up()
    obj.ref_count_down()
    assert a.used_bytes == ALIGN and obj.get_ref_count() == 1
    obj.ref_count_down()
    assert a.used_bytes == 0 and not obj.valid
    with pytest.raises(RuntimeError):
        obj.ref_count_down()
    with pytest.raises(RuntimeError):
        obj.ref_count_up()
    with pytest.raises(ValueError, match="double"):
        a.free(obj)


def test_empty_allocation_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        alloc().allocate((0, 4), torch.float32)


@pytest.mark.parametrize("shape", [(2**32, 2**32), (2**25, 2**39), (65 * ALIGN,)],
                         ids=["numel-wraps-to-0", "bytes-wrap-to-0", "larger-than-the-buffer"])
def test_an_object_larger_than_the_whole_buffer_never_fits_and_grows_nothing(shape):
    a = TensorMemoryAllocator(torch.zeros(64 * ALIGN, dtype=torch.uint8), grow_bytes=ALIGN)
    assert a.allocate(shape, torch.bfloat16) is None
    assert a.grown == ALIGN and a.used_bytes == 0
    a.check_integrity()


def test_allocate_many_gives_back_what_it_took_when_an_allocation_raises():
    a = alloc()
    real = a.allocate

    def failing_third(shape, dtype, fmt):
        if shape[0] == 3:
            raise RuntimeError("the device failed")
        return real(shape, dtype, fmt)

    a.allocate = failing_third
    with pytest.raises(RuntimeError, match="device failed"):
        a.allocate_many([torch.Size([1]), torch.Size([2]), torch.Size([3])], torch.uint8)
    assert a.used_bytes == 0
    a.check_integrity()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), min_size=1, max_size=80),
       st.integers(0, 2**32))
def test_integrity_holds_under_random_alloc_free(ops, seed):
    rnd = random.Random(seed)
    a = alloc(32 * ALIGN)
    live = []
    for is_alloc, size in ops:
        if is_alloc or not live:
            obj = a.allocate((size,), torch.uint8)
            if obj is not None:
                live.append(obj)
        else:
            live.pop(rnd.randrange(len(live))).ref_count_down()
        a.check_integrity()
        assert a.used_bytes == sum(o.metadata.phy_size for o in live)
    for obj in live:
        obj.ref_count_down()
    a.check_integrity()
    assert a.allocate((32 * ALIGN,), torch.uint8) is not None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), min_size=1, max_size=80),
       st.integers(1, 6), st.integers(0, 2**32))
def test_a_growing_arena_keeps_first_fit_guarantees_and_every_live_byte(ops, step, seed):
    """Touched in pieces of `step` blocks (the next one in the background): integrity holds at
    every step, it never grows past its size, an allocation fails only once it is fully grown, and
    growth never touches a live object's bytes."""
    rnd = random.Random(seed)
    a = TensorMemoryAllocator(torch.full((32 * ALIGN,), 7, dtype=torch.uint8), grow_bytes=step * ALIGN)

    def mark(obj) -> int:  # never 0, the value a touched page has
        return obj.metadata.address // ALIGN % 250 + 1

    assert a.grown == min(step, 32) * ALIGN
    live = []
    for is_alloc, size in ops:
        if is_alloc or not live:
            obj = a.allocate((size,), torch.uint8)
            if obj is None:  # no room: fully grown, and so for good, not for a growth in flight
                assert a.grown == a.total and a.allocate((size,), torch.uint8) is None
            else:
                obj.tensor.fill_(mark(obj))
                live.append(obj)
        else:
            live.pop(rnd.randrange(len(live))).ref_count_down()
        if rnd.random() < 0.5:
            assert a.wait_grown(10)  # the background piece, if one was started, is in
        a.check_integrity()
        assert a.grown <= a.total
        for obj in live:
            assert bool((obj.tensor == mark(obj)).all())
    assert a.wait_grown(10)
    a.check_integrity()
    for obj in live:
        obj.ref_count_down()
    a.close()


def test_concurrent_allocations_fill_a_growing_arena_exactly():
    """Threads take one-block objects while the arena grows a block at a time (in the background
    too): every block of it is handed out, none twice, and only a full arena says no."""
    import threading

    for _ in range(20):
        a = TensorMemoryAllocator(torch.zeros(64 * ALIGN, dtype=torch.uint8), grow_bytes=ALIGN)
        got: list = []

        def take(a=a, got=got):
            while (obj := a.allocate((ALIGN,), torch.uint8)) is not None:
                got.append(obj)

        threads = [threading.Thread(target=take) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(o.metadata.address for o in got) == [i * ALIGN for i in range(64)]
        a.check_integrity()


def test_an_idle_host_arena_keeps_one_piece_resident_and_grows_as_it_fills():
    from lmcache.memory_management.allocators import GROW_BYTES

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    a = HostMemoryAllocator(8 * GROW_BYTES)
    assert a.wait_grown(30)
    assert a.grown == GROW_BYTES and rss() - before < GROW_BYTES + (64 << 20)
    objs = [a.allocate((GROW_BYTES // 2,), torch.uint8) for _ in range(5)]  # 2.5 pieces
    assert all(o is not None for o in objs)
    assert a.wait_grown(30)
    assert 3 * GROW_BYTES <= a.grown <= 4 * GROW_BYTES  # what is used, and at most a piece ahead
    a.check_integrity()
    for o in objs:
        o.ref_count_down()
    a.close()
    assert rss() - before < 64 << 20


def test_check_integrity_detects_corruption():
    a = alloc(4 * ALIGN)
    a.allocate((ALIGN,), torch.uint8)
    a._free[0].start += ALIGN  # simulate a bookkeeping bug
    with pytest.raises(AssertionError):
        a.check_integrity()


def test_host_and_pin_allocators_allocate_and_pin_falls_back_without_cuda():
    h = HostMemoryAllocator(8 * ALIGN)
    assert h.allocate((ALIGN,), torch.uint8) is not None
    p = PinMemoryAllocator(8 * ALIGN)
    assert p.is_pinned == torch.cuda.is_available()
    assert p.buffer.is_pinned() == p.is_pinned
    with pytest.raises(ValueError):
        HostMemoryAllocator(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_gpu_allocator_without_cuda_gives_a_clear_error():
    with pytest.raises(ValueError, match="not usable"):
        GPUMemoryAllocator(ALIGN)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_allocator_allocates_on_the_device():
    obj = GPUMemoryAllocator(8 * ALIGN).allocate((4, 4), torch.float16)
    assert obj is not None and obj.tensor.is_cuda


def test_mixed_allocator_puts_binary_buffers_in_bytes_and_tensors_in_the_arena():
    m = MixedMemoryAllocator(8 * ALIGN)
    blob = m.allocate((100,), None, MemoryFormat.BINARY_BUFFER)
    assert isinstance(blob, BytesBufferMemoryObj) and len(blob.byte_array) == 100
    kv = m.allocate((2, 2, 4, 8), torch.bfloat16, MemoryFormat.KV_BLOB)
    assert kv is not None and kv.tensor is not None and m.used_bytes == ALIGN
    kv.ref_count_down()
    blob.ref_count_down()
    assert m.used_bytes == 0
    m.check_integrity()


def test_buffer_allocator_and_bytes_objects():
    b = BufferAllocator()
    obj = b.allocate((10,), None)
    assert obj.get_memory_format() == MemoryFormat.BINARY_BUFFER and obj.tensor is None
    raw = BytesBufferMemoryObj(b"abc")
    assert bytes(raw.byte_array) == b"abc" and raw.get_size() == 3


ALLOCATORS = {
    "tensor": lambda: HostMemoryAllocator(16 * ALIGN),
    "pinned": lambda: PinMemoryAllocator(16 * ALIGN),
    "mixed": lambda: MixedMemoryAllocator(16 * ALIGN),
    "bytes": BufferAllocator,
}


@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 3 * ALIGN), st.booleans()), min_size=1,
                    max_size=40),
       seed=st.integers(0, 2**32))
def test_a_freed_object_exposes_no_memory_whatever_the_allocate_free_order(kind, ops, seed):
    a = ALLOCATORS[kind]()
    rnd = random.Random(seed)
    live, freed = [], []
    for n, (is_alloc, size, binary) in enumerate(ops):
        if is_alloc or not live:
            fmt = MemoryFormat.BINARY_BUFFER if binary or kind == "bytes" else MemoryFormat.KV_BLOB
            obj = a.allocate((size,), torch.uint8, fmt)
            if obj is None:
                continue
            obj.byte_array[:] = bytes([n % 251]) * size  # a pattern only this object writes
            live.append((obj, n % 251))
        else:
            obj, _ = live.pop(rnd.randrange(len(live)))
            obj.ref_count_down()
            freed.append(obj)
        for obj in freed:
            assert obj.tensor is None
            with pytest.raises(RuntimeError, match="freed"):
                obj.byte_array  # noqa: B018 - the access itself must raise
        for obj, mark in live:  # a freed neighbour never handed out bytes that a live object owns
            assert bytes(obj.byte_array) == bytes([mark]) * obj.get_size()
            assert obj.tensor is None or bool((obj.tensor == mark).all())
    for obj, _ in live:
        obj.ref_count_down()


@pytest.mark.skipif(sys.platform != "linux", reason="thread priorities are per thread on Linux only")
def test_the_background_growth_runs_at_the_lowest_cpu_priority_and_the_caller_keeps_its_own():
    """The next piece is touched by a thread at niceness 19: on cores the engine keeps busy, its
    page faults wait for idle time instead of delaying the engine's threads."""
    import os
    import threading

    from lmcache.memory_management.tensor_allocator import GROWER_NICENESS

    seen: list[int] = []

    class Recording(TensorMemoryAllocator):
        def _grow(self, nbytes, seen_bytes=None, touch=True):
            if threading.current_thread() is not threading.main_thread():
                seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return super()._grow(nbytes, seen_bytes, touch)

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    a = Recording(torch.zeros(8 * ALIGN, dtype=torch.uint8), grow_bytes=2 * ALIGN)
    assert a.allocate((ALIGN,), torch.uint8) is not None  # 1 of 2 blocks used: the next piece starts
    assert a.wait_grown(10)
    assert seen == [max(GROWER_NICENESS, before)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    a.close()
