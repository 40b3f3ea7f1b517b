import pytest
import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.memory_management import MemoryFormat, TensorMemoryAllocator
from lmcache.storage_backend.events import EventKind
from lmcache.storage_backend.evictor import EvictionDomain, FIFOPolicy, LFUPolicy, LRUPolicy, make_policy
from lmcache.storage_backend.local_cpu_backend import LocalCPUBackend

ALIGN = TensorMemoryAllocator.ALIGN_BYTES


def key(i):
    return CacheEngineKey("kv_blob", "m", 1, 0, f"{i:032x}", "uint8")


def test_lru_evicts_least_recently_used_first():
    p = LRUPolicy()
    for k in "abc":
        p.on_insert(k)
    p.on_access("a")
    assert list(p.candidates()) == ["b", "c", "a"]


def test_fifo_ignores_accesses():
    p = FIFOPolicy()
    for k in "abc":
        p.on_insert(k)
    p.on_access("a")
    assert list(p.candidates()) == ["a", "b", "c"]


def test_lfu_evicts_least_frequent_then_least_recent():
    p = LFUPolicy()
    for k in "abcd":
        p.on_insert(k)
    for k in "aab":
        p.on_access(k)
    p.on_remove("d")
    assert list(p.candidates()) == ["c", "b", "a"]


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="MRU"):
        make_policy("MRU")


def backend(slots=4, policy="LRU"):
    return LocalCPUBackend(TensorMemoryAllocator(torch.zeros(slots * ALIGN, dtype=torch.uint8)), policy)


def put(b, i):
    obj = b.allocate(torch.Size([ALIGN]), torch.uint8, MemoryFormat.KV_BLOB)
    assert obj is not None
    obj.tensor.fill_(i)
    b.submit_put_task(key(i), obj)
    obj.ref_count_down()
    return obj


@pytest.mark.parametrize(("policy", "touched", "survivor_expected"),
                         [("LRU", 0, True), ("FIFO", 0, False), ("LFU", 0, True)])
def test_allocation_evicts_in_policy_order(policy, touched, survivor_expected):
    b = backend(3, policy)
    for i in range(3):
        put(b, i)
    got = b.get_blocking(key(touched))
    got.ref_count_down()
    put(b, 3)
    assert b.contains(key(touched)) == survivor_expected
    assert b.contains(key(3)) and len(b) == 3 and b.num_evicted == 1


def test_objects_held_by_someone_else_are_not_evicted():
    b = backend(2)
    put(b, 0)
    put(b, 1)
    held = b.get_blocking(key(0))  # a reader holds chunk 0 (the LRU victim)
    put(b, 2)
    assert b.contains(key(0)) and not b.contains(key(1))
    assert bool((held.tensor == 0).all())
    other = b.get_blocking(key(2))
    assert b.allocate(torch.Size([ALIGN]), torch.uint8) is None  # everything is held
    held.ref_count_down()
    other.ref_count_down()


def test_an_allocation_larger_than_the_whole_arena_evicts_nothing():
    b = backend(3)
    for i in range(3):
        put(b, i)
    assert b.allocate(torch.Size([4 * ALIGN]), torch.uint8) is None  # no eviction can make it fit
    assert len(b) == 3 and b.num_evicted == 0
    obj = b.allocate(torch.Size([2 * ALIGN]), torch.uint8)  # one that fits still evicts
    assert obj is not None and len(b) == 1 and b.num_evicted == 2
    obj.ref_count_down()


def test_pinned_objects_are_not_evicted_until_unpinned():
    b = backend(2)
    put(b, 0)
    put(b, 1)
    b.pins.pin([key(0), key(9)])  # pins are by key: 9 is not here (yet)
    put(b, 2)
    assert b.contains(key(0)) and not b.contains(key(1))
    b.pins.unpin([key(0), key(9)])
    b.get_blocking(key(2)).ref_count_down()
    put(b, 3)
    assert not b.contains(key(0))


def test_duplicate_put_keeps_the_first_and_remove_frees():
    b = backend(4)
    first = put(b, 1)
    second = b.allocate(torch.Size([ALIGN]), torch.uint8)
    b.submit_put_task(key(1), second)
    assert second.get_ref_count() == 1  # not taken
    second.ref_count_down()
    got = b.get_blocking(key(1))
    assert got is first
    got.ref_count_down()
    assert b.remove(key(1)) and not b.remove(key(1))
    assert not first.valid
    b.allocator.check_integrity()


def test_close_releases_everything():
    b = backend(4)
    for i in range(4):
        put(b, i)
    b.close()
    assert len(b) == 0 and b.allocator.used_bytes == 0


def test_hot_tiers_sharing_an_arena_evict_in_one_order():
    """Two hot tiers on one arena with one `EvictionDomain` (the cache server's models): a full
    arena evicts the least recently used chunk of either tier, each reported by its own tier;
    a pinned chunk of the other tier is skipped. Equal keys of the two tiers stay apart."""
    arena = TensorMemoryAllocator(torch.zeros(4 * ALIGN, dtype=torch.uint8))
    domain = EvictionDomain("LRU")
    a = LocalCPUBackend(arena, domain=domain)
    b = LocalCPUBackend(arena, domain=domain)
    removed = {"a": [], "b": []}

    def take_removed():
        for name, tier in (("a", a), ("b", b)):
            removed[name] += [k for e in tier.take_events() if e.kind is EventKind.REMOVED for k in e.keys]
        return removed

    put(a, 0)
    put(a, 1)
    put(b, 0)  # the same key as a's first chunk, another tier's chunk
    put(b, 2)
    a.get_blocking(key(0)).ref_count_down()  # a's chunk 0 is now the most recently used
    a.pins.pin([key(1)])  # and a's chunk 1 is pinned
    put(b, 3)  # the arena is full: b's own chunk 0 is the least recently used that may go
    assert (take_removed(), b.num_evicted, a.num_evicted) == ({"a": [], "b": [key(0)]}, 1, 0)
    put(b, 4)  # next: a's chunk 1 is pinned, so b's chunk 2
    assert take_removed() == {"a": [], "b": [key(0), key(2)]}
    a.pins.unpin([key(1)])
    put(b, 5)  # now a's chunk 1, the least recently used, goes: b evicted a's chunk
    assert take_removed() == {"a": [key(1)], "b": [key(0), key(2)]} and a.num_evicted == 1
    assert sorted(k.chunk_hash for k in a.keys()) == [key(0).chunk_hash]
    assert b.contains(key(3)) and b.contains(key(4)) and b.contains(key(5)) and not b.contains(key(0))
    a.check_integrity(at_rest=True)
    b.check_integrity(at_rest=True)
    assert arena.used_bytes == 4 * ALIGN
