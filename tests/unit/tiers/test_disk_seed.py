"""Seed 000's per-key calls on its `LocalDiskBackend` (the seed path, served by
`lmcache.compat.disk_seed`): each one on a real directory, and the class is the core tier's."""

import os

import pytest
import torch

from lmcache.experimental.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.storage_backend import local_disk_backend
from lmcache.storage_backend.disk_file import SUFFIX
from tests.helpers import WRITE_WAIT


@pytest.fixture
def disk(disk_config, meta, allocator):
    d = LocalDiskBackend(disk_config(), meta, allocator.allocate)
    yield d
    d.close()


def put(backend, k, obj):
    backend.submit_put_task(k, obj)
    assert backend.puts.flush(WRITE_WAIT)


def test_the_seed_class_is_the_core_disk_tier_with_the_seed_calls():
    assert issubclass(LocalDiskBackend, local_disk_backend.LocalDiskBackend)
    assert LocalDiskBackend.name == "LocalDiskBackend"
    for name in ("insert_key", "async_load_bytes_from_disk", "submit_prefetch_task"):
        assert not hasattr(local_disk_backend.LocalDiskBackend, name)  # the core never calls them


def test_prefetch_loads_into_a_new_buffer_and_a_closed_tier_prefetches_nothing(disk, make_obj, key):
    obj = make_obj(1)
    put(disk, key(1), obj)
    got = disk.submit_prefetch_task(key(1)).result(5)
    assert got is not obj and torch.equal(got.tensor, obj.tensor)
    got.ref_count_down()
    assert disk.submit_prefetch_task(key(2)).result(5) is None
    disk.close()
    assert disk.submit_prefetch_task(key(1)) is None


def test_async_load_reads_the_file_into_a_new_buffer(disk, make_obj, key):
    obj = make_obj(1)
    put(disk, key(1), obj)
    got = disk.async_load_bytes_from_disk(key(1)).result(5)
    assert got is not obj and torch.equal(got.tensor, obj.tensor)
    got.ref_count_down()
    assert disk.async_load_bytes_from_disk(key(2)).result(5) is None


def test_async_load_on_a_closed_tier_is_a_miss_not_an_error(disk, make_obj, key):
    put(disk, key(1), make_obj(1))
    disk.close()
    assert disk.async_load_bytes_from_disk(key(1)).result(5) is None  # raised RuntimeError


def test_insert_key_indexes_a_file_and_evicts_to_stay_within_the_limit(disk, make_obj, key):
    put(disk, key(1), make_obj(1))
    disk.insert_key(key(2), disk.max_bytes)  # as large as the whole tier: key 1's file goes
    assert disk.contains(key(2)) and disk.used_bytes == disk.max_bytes
    assert not disk.contains(key(1)) and not any(n.endswith(SUFFIX) for n in os.listdir(disk.path))
    with pytest.raises(ValueError, match="size"):
        disk.insert_key(key(3), -1)
    assert not disk.contains(key(3)) and disk.used_bytes == disk.max_bytes
