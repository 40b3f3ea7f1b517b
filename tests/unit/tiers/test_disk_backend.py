import os
import time

import pytest
import torch

from lmcache.memory_management import MemoryFormat
from lmcache.storage_backend.disk_file import SUFFIX
from lmcache.storage_backend.leases import PinTable
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend
from tests.helpers import WRITE_WAIT


@pytest.fixture
def disk(disk_config, meta, allocator):
    backends = []

    def make(size_bytes=1 << 20, **kw):
        b = LocalDiskBackend(disk_config(size_bytes, **kw), meta, allocator.allocate)
        backends.append(b)
        return b

    yield make
    for b in backends:
        b.close()


def put(backend, k, obj):
    backend.submit_put_task(k, obj)
    assert backend.puts.flush(WRITE_WAIT)


def files(backend):
    return sorted(n for n in os.listdir(backend.path) if n.endswith(SUFFIX))


@pytest.mark.parametrize("serde", ["naive", "fast", "torch", "safe"])
def test_put_then_get_round_trips_through_a_file(disk, make_obj, key, serde):
    d = disk(local_disk_serde=serde)
    obj = make_obj(1)
    put(d, key(1), obj)
    assert d.contains(key(1)) and len(files(d)) == 1
    got = d.get_blocking(key(1))
    assert got is not None and got is not obj and torch.equal(got.tensor, obj.tensor)
    assert got.get_ref_count() == 1
    assert d.get_blocking(key(2)) is None


def test_a_restarted_backend_finds_what_is_on_disk(disk, make_obj, key):
    d1 = disk()
    objs = [make_obj(i) for i in range(3)]
    for i, o in enumerate(objs):
        put(d1, key(i), o)
    d1.close()
    d2 = disk()
    assert d2.stats().gauges["files"] == 3 and d2.used_bytes == d1.used_bytes
    for i, o in enumerate(objs):
        got = d2.get_blocking(key(i))
        assert torch.equal(got.tensor, o.tensor)
        got.ref_count_down()


def test_eviction_keeps_the_directory_within_max_size_lru_first(disk, make_obj, key):
    probe = disk(1 << 20)
    put(probe, key(100), make_obj(100))
    file_size = probe.used_bytes
    probe.remove(key(100))
    d = disk(3 * file_size + file_size // 2)  # room for three files
    for i in range(3):
        put(d, key(i), make_obj(i))
    d.get_blocking(key(0)).ref_count_down()  # key 0 becomes most recently used
    put(d, key(3), make_obj(3))
    assert [d.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert len(files(d)) == 3 and d.used_bytes <= d.max_bytes and d.num_evicted == 1


def test_a_chunk_larger_than_the_whole_tier_is_dropped_and_not_counted_written(disk, make_obj, key):
    d = disk(100)
    put(d, key(1), make_obj(1))
    assert not d.contains(key(1)) and files(d) == []
    counters = d.stats().counters
    assert (counters["too_large"], counters["puts_dropped"]) == (1, 1)
    assert (counters["puts_written"], counters["bytes_written"], counters["failures"]) == (0, 0, 0)


def test_a_put_that_fits_only_if_pinned_files_went_is_dropped_and_evicts_nothing(disk_config, meta, allocator,
                                                                                 disk, make_obj, key):
    small = allocator.allocate(torch.Size([2, 1, 2, 8]), torch.bfloat16, MemoryFormat.KV_BLOB)
    probe = disk()
    put(probe, key(100), make_obj(100))
    put(probe, key(101), small)
    size, small_size = (os.path.getsize(probe._key_to_path(key(i))) for i in (100, 101))
    probe.clear()  # the same directory as the tier below
    pins = PinTable()
    d = LocalDiskBackend(disk_config(2 * size + small_size + size // 2), meta, allocator.allocate, pins=pins)
    try:
        for i, obj in enumerate([make_obj(0), make_obj(1), small]):
            put(d, key(i), obj)
        pins.pin([key(0), key(1)])  # a lookup holds both big files; evicting the small one is not enough
        put(d, key(3), make_obj(3))
        assert [d.contains(key(i)) for i in range(4)] == [True, True, True, False]
        assert d.used_bytes == sum(os.path.getsize(os.path.join(d.path, f)) for f in files(d)) <= d.max_bytes
        counters = d.stats().counters
        assert (counters["no_room"], counters["puts_dropped"], counters["evicted"]) == (1, 1, 0)
        pins.unpin([key(0), key(1)])
        put(d, key(3), make_obj(3))  # once the lookup is done, LRU files make room again
        assert [d.contains(key(i)) for i in range(4)] == [False, True, True, True]
        assert d.used_bytes <= d.max_bytes
    finally:
        d.close()


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_key", "flip_header", "dim_overflow",
                                    "empty", "garbage"])
def test_a_damaged_file_is_a_miss_and_is_removed(disk, make_obj, key, damage):
    d = disk()
    put(d, key(1), make_obj(1))
    path = d._key_to_path(key(1))
    data = bytearray(open(path, "rb").read())
    blob_at = 8 + len(key(1).to_string())  # after the keyed head
    if damage == "dim_overflow":
        data[blob_at + 8 + 7] ^= 0x80  # the top bit of the first shape dim (>= 2**63)
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip_payload":
        data[-50] ^= 0x04
    elif damage == "flip_key":
        data[12] ^= 0x01
    elif damage == "flip_header":
        data[-(len(data) - 8 - len(key(1).to_string()) - 30)] ^= 0x80
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(os.urandom(len(data)))
    open(path, "wb").write(data)
    assert d.get_blocking(key(1)) is None
    assert not os.path.exists(path) and not d.contains(key(1)) and d.num_corrupt == 1
    put(d, key(1), make_obj(1))  # and it can be stored again
    assert d.get_blocking(key(1)) is not None


def test_a_file_from_another_serde_is_a_miss_but_kept(disk, make_obj, key):
    put(disk(local_disk_serde="torch"), key(1), make_obj(1))
    d = disk(local_disk_serde="naive")
    assert d.get_blocking(key(1)) is None
    assert d.num_corrupt == 0 and os.path.exists(d._key_to_path(key(1)))


def test_two_backends_sharing_a_directory_see_each_others_files(disk, make_obj, key):
    a, b = disk(), disk()
    obj = make_obj(1)
    put(a, key(1), obj)
    assert b.contains(key(1))
    got = b.get_blocking(key(1))
    assert torch.equal(got.tensor, obj.tensor)


def test_load_disk_removes_temporary_files_of_dead_writers_only(disk, make_obj, key):
    d = disk()
    dead = os.path.join(d.path, "abc.999999999.deadbeef.tmp")
    live = os.path.join(d.path, f"abd.{os.getppid()}.cafe.tmp")
    old = os.path.join(d.path, f"abe.{os.getppid()}.cafe.tmp")
    for p in (dead, live, old):
        open(p, "wb").write(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    open(os.path.join(d.path, "tiny" + SUFFIX), "wb").write(b"x")
    d.load_disk()
    assert sorted(os.listdir(d.path)) == [os.path.basename(live)]


def test_get_while_the_write_is_in_flight_is_served_from_memory(disk, make_obj, key):
    d = disk()
    obj = make_obj(1)
    d.puts._executor.submit(time.sleep, 0.3)  # occupy a worker so the put may still be queued
    d.puts._executor.submit(time.sleep, 0.3)
    d.submit_put_task(key(1), obj)
    assert d.exists_in_put_tasks(key(1))
    got = d.get_blocking(key(1))
    assert got is obj
    got.ref_count_down()
    assert d.puts.flush(WRITE_WAIT)
    assert not d.exists_in_put_tasks(key(1)) and d.contains(key(1))


def test_get_when_allocate_has_no_room_is_a_miss_and_keeps_the_file(disk_config, meta, make_obj, key):
    d = LocalDiskBackend(disk_config(), meta, lambda *a: None)
    put(d, key(1), make_obj(1))
    assert d.get_blocking(key(1)) is None and d.contains(key(1)) and d.num_corrupt == 0
    d.close()


def test_fsync_policy_still_round_trips(disk, make_obj, key):
    d = disk(local_disk_fsync=True)
    obj = make_obj(1)
    put(d, key(1), obj)
    assert torch.equal(d.get_blocking(key(1)).tensor, obj.tensor)


def test_remove_deletes_the_file(disk, make_obj, key):
    d = disk()
    put(d, key(1), make_obj(1))
    assert d.remove(key(1)) and not d.remove(key(1))
    assert files(d) == [] and d.used_bytes == 0


def test_a_disk_tier_without_a_size_limit_is_rejected(disk_config, meta, allocator):
    with pytest.raises(ValueError, match="size limit"):
        LocalDiskBackend(disk_config(0), meta, allocator.allocate)
