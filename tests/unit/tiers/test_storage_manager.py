"""`StorageManager` at prefix level over the hot and disk tiers, and the tier registry."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lmcache.config import LMCacheEngineConfig
from lmcache.failures import FailureDomains
from lmcache.memory_management import MixedMemoryAllocator, release_all
from lmcache.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.storage_backend.cache_server_backend import CacheServerBackend
from lmcache.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.storage_backend.pd_backend import PDBackend
from lmcache.storage_backend.peer_backend import PeerBackend
from lmcache.storage_backend.registry import register_tier, tier_classes, tier_names
from lmcache.storage_backend.remote_backend import RemoteBackend
from lmcache.storage_backend.storage_manager import StorageManager
from tests.helpers import WRITE_WAIT
from tests.helpers.clock import ManualClock


@pytest.fixture
def manager(disk_config, meta):
    alloc = MixedMemoryAllocator(1 << 20)
    sm = StorageManager(disk_config(), meta, alloc)
    yield sm
    sm.close()
    assert alloc.used_bytes == 0  # every reference handed out came back


def store(sm, keys, make_obj, seeds):
    for k, seed in zip(keys, seeds):
        obj = make_obj(seed)
        sm.put(k, obj)
        obj.ref_count_down()
    assert sm.backends["LocalDiskBackend"].puts.flush(WRITE_WAIT)


def test_registry_lists_the_tiers_in_lookup_order_with_their_properties():
    assert tier_classes() == [LocalCPUBackend, CacheServerBackend, PDBackend, LocalDiskBackend, RemoteBackend,
                              PeerBackend]
    assert tier_names() == {"Hot": "Hot", "LocalCPUBackend": "Hot", "CacheServer": "CacheServer",
                            "PDBackend": "PDBackend",
                            "PD": "PDBackend", "LocalDiskBackend": "LocalDiskBackend",
                            "RemoteBackend": "RemoteBackend", "PeerBackend": "PeerBackend",
                            "P2PBackend": "PeerBackend"}
    assert [(c.is_local, c.may_fail) for c in tier_classes()] == [(True, False), (True, False), (True, False),
                                                                  (True, True), (False, True), (False, True)]


def test_a_second_tier_with_a_taken_name_is_refused():
    class Impostor(LocalDiskBackend):
        name = "LocalCPUBackend"  # the hot tier's alias

    with pytest.raises(ValueError, match="taken"):
        register_tier(Impostor)
    assert tier_classes() == [LocalCPUBackend, CacheServerBackend, PDBackend, LocalDiskBackend, RemoteBackend,
                              PeerBackend]


def test_config_values_come_from_the_registries():
    from lmcache.storage_backend.connectors import remote_schemes
    from lmcache.storage_backend.serde import serde_names

    with pytest.raises(ValueError) as err:
        LMCacheEngineConfig.from_defaults(remote_url="nope://h:1")
    assert all(f"{s}://" in str(err.value) for s in remote_schemes())
    with pytest.raises(ValueError) as err:
        LMCacheEngineConfig.from_defaults(remote_serde="zip")
    assert all(s in str(err.value) for s in serde_names())


def test_contains_prefix_says_which_tier_holds_each_chunk(manager, key, make_obj):
    keys = [key(i) for i in range(5)]
    store(manager, keys[:4], make_obj, range(4))
    manager.hot.remove(keys[1])
    manager.hot.remove(keys[2])
    found = manager.contains_prefix(keys)
    disk = manager.backends["LocalDiskBackend"]
    assert found.hits == 4 and found.tiers == [manager.hot, disk, disk, manager.hot]
    assert manager.contains_prefix(keys, "Hot").hits == 1
    assert manager.contains_prefix(keys, ["LocalDiskBackend"]).hits == 4
    assert manager.contains_prefix(keys[1:], "LocalCPUBackend").hits == 0


def test_get_prefix_mixes_tiers_promotes_and_stops_at_the_first_gap(manager, key, make_obj):
    keys = [key(i) for i in range(6)]
    store(manager, keys[:3] + keys[4:], make_obj, [0, 1, 2, 4, 5])  # chunk 3 is missing
    manager.hot.remove(keys[1])
    manager.hot.remove(keys[5])
    objs = manager.get_prefix(keys)
    assert len(objs) == 3  # 0 (hot), 1 (disk), 2 (hot); 3 is a gap; 4 and 5 are not handed out
    expected = [make_obj(i) for i in range(3)]
    assert all(torch.equal(o.tensor, e.tensor) for o, e in zip(objs, expected))
    assert manager.hot.contains(keys[1])  # promoted
    assert not manager.hot.contains(keys[5])  # past the gap: not promoted, evicting nothing
    stats = manager.stats()
    assert stats["Hot"].counters.get("hits") == 2  # chunks 0 and 2, served; 4 was not
    assert stats["LocalDiskBackend"].counters.get("hits") == 1  # chunk 1; 5 was not served
    assert stats["Hot"].counters.get("bytes_read") == 2 * objs[0].get_size()
    for obj in objs + expected:
        obj.ref_count_down()


def test_prefetch_loads_what_a_lookup_found_and_a_get_joins_it(manager, key, make_obj):
    keys = [key(i) for i in range(4)]
    store(manager, keys, make_obj, range(4))
    manager.hot.clear()
    found = manager.contains_prefix(keys)
    assert manager.prefetch(found) == 4
    assert manager.prefetch(manager.contains_prefix(keys)) == 0  # already loading or hot
    objs = manager.get_prefix(keys)
    assert len(objs) == 4 and all(manager.hot.contains(k) for k in keys)
    for obj in objs:
        obj.ref_count_down()


def test_a_get_that_fails_after_joining_a_load_leaves_no_reference_behind(disk_config, meta, key, make_obj,
                                                                         monkeypatch):
    """A get that joined a prefetch in flight and then failed (a tier that does not guard its calls
    raised) takes nothing from that load: the chunk it brings stays evictable, the arena empties."""
    alloc = MixedMemoryAllocator(1 << 20)
    sm = StorageManager(disk_config(), meta, alloc)
    store(sm, [key(0), key(1)], make_obj, [0, 1])
    sm.clear("hot")
    disk = sm.backends["LocalDiskBackend"]
    read, gate = disk.batched_get, threading.Event()

    def get(keys):
        if keys != [key(0)]:
            raise RuntimeError("a bug in the tier")
        gate.wait(WRITE_WAIT)  # the prefetch stays in flight until the get has failed
        return read(keys)

    monkeypatch.setattr(disk, "may_fail", False)
    monkeypatch.setattr(disk, "batched_get", get)
    assert sm.prefetch(sm.contains_prefix([key(0)])) == 1
    with pytest.raises(RuntimeError, match="bug"):
        sm.get_prefix([key(0), key(1)])
    gate.set()
    sm.close()  # waits for the load
    assert alloc.used_bytes == 0


def test_without_a_hot_tier_prefetch_has_nowhere_to_load(disk_config, meta, key, make_obj):
    alloc = MixedMemoryAllocator(1 << 20)
    sm = StorageManager(disk_config(local_cpu=False), meta, alloc)
    assert sm.hot is None and [t.name for t in sm.tiers] == ["LocalDiskBackend"]
    store(sm, [key(0)], make_obj, [0])
    assert sm.prefetch(sm.contains_prefix([key(0)])) == 0
    (obj,) = sm.get_prefix([key(0)])
    obj.ref_count_down()
    sm.close()


def test_stored_locally_asks_only_local_tiers(disk_config, meta, key, make_obj):
    sm = StorageManager(disk_config(remote_url="redis://127.0.0.1:1?backoff=10"), meta,
                        MixedMemoryAllocator(1 << 20))
    remote = sm.backends["RemoteBackend"]
    asked = []
    remote.batched_contains = lambda keys: asked.append(keys) or [True] * len(keys)  # type: ignore[method-assign]
    store(sm, [key(0)], make_obj, [0])
    assert sm.stored_locally([key(0), key(1)]) == [True, False] and asked == []
    sm.close()


def test_the_interface_declares_safe_defaults():
    assert StorageBackendInterface.may_fail and StorageBackendInterface.is_local
    with pytest.raises(NotImplementedError):
        StorageBackendInterface.create(None)  # type: ignore[arg-type]


def test_a_failing_tier_is_a_miss_backed_off_counted_and_warned_once(disk_config, meta, key, make_obj,
                                                                    monkeypatch, caplog):
    clock = ManualClock()
    alloc = MixedMemoryAllocator(1 << 20)
    sm = StorageManager(disk_config(), meta, alloc,
                        faults=FailureDomains(lambda name: f"storage tier {name}", 0.5, 4.0, clock=clock))
    disk = sm.backends["LocalDiskBackend"]
    store(sm, [key(0)], make_obj, [0])
    sm.clear("hot")
    calls = []

    def eio(keys):  # an I/O error a healthy test disk cannot produce
        calls.append(keys)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(disk, "batched_contains", eio)
    with caplog.at_level("WARNING"):
        assert sm.contains_prefix([key(0)]).hits == 0  # a miss, not an error
        assert sm.contains_prefix([key(0)]).hits == 0  # backing off: the disk is not asked
    assert len(calls) == 1 and sm.stats()["LocalDiskBackend"].counters["failures"] == 1
    assert [r.message for r in caplog.records].count(
        "storage tier LocalDiskBackend failed (treated as a cache miss): [Errno 5] Input/output error") == 1
    monkeypatch.undo()
    clock.advance(0.5)
    assert sm.contains_prefix([key(0)]).hits == 1 and sm.health()["LocalDiskBackend"]
    sm.close()


def test_a_disk_file_with_an_overflowing_header_costs_its_own_chunk_only(manager, key, make_obj):
    """A bad file is the disk's answer, not a disk fault: a miss, deleted and counted, while
    the tier keeps serving the other chunks (no backoff)."""
    store(manager, [key(1), key(2)], make_obj, [1, 2])
    manager.clear("hot")
    disk = manager.backends["LocalDiskBackend"]
    path = disk._key_to_path(key(1))
    data = bytearray(open(path, "rb").read())
    data[8 + len(key(1).to_string()) + 8 + 7] ^= 0x80  # the blob header's first dim: >= 2**63
    open(path, "wb").write(data)
    assert manager.get_prefix([key(1)]) == []
    (got,) = manager.get_prefix([key(2)])
    got.ref_count_down()
    counters = manager.stats()["LocalDiskBackend"].counters
    assert (counters["corrupt"], counters["failures"], counters["skipped"]) == (1, 0, 0)
    assert not os.path.exists(path)


def test_a_tiers_failures_add_up_over_the_guards_that_caught_them(disk_config, meta, key, make_obj,
                                                                   monkeypatch):
    """A failed read is the manager's to count, a failed background write the put queue's; the
    tier's numbers are their sum (merged, never one replacing the other)."""
    sm = StorageManager(disk_config(), meta, MixedMemoryAllocator(1 << 20))
    disk = sm.backends["LocalDiskBackend"]

    def eio(*args):  # I/O errors a healthy test disk cannot produce
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(disk, "batched_contains", eio)
    monkeypatch.setattr(disk.puts, "_write", eio)
    store(sm, [key(0)], make_obj, [0])
    assert disk.puts.flush(WRITE_WAIT)
    sm.clear("hot")
    assert sm.contains_prefix([key(0)]).hits == 0
    counters = sm.stats()["LocalDiskBackend"].counters
    assert counters["failures"] == 2 and counters["puts_failed"] == 1
    assert counters["puts_written"] == 0 and counters["bytes_written"] == 0
    monkeypatch.undo()
    sm.close()


def test_a_tier_answering_a_prefetch_with_too_few_objects_leaves_no_load_hanging(manager, key, make_obj,
                                                                                monkeypatch):
    """A lower tier whose `batched_get` answers fewer objects than keys (a bug in that tier): its
    answer is all misses, released. The prefetch marked only the first loads done and left the
    others in flight for good, so a get joining them waited forever."""
    keys = [key(i) for i in range(3)]
    store(manager, keys, make_obj, range(3))
    manager.hot.clear()
    disk = manager.backends["LocalDiskBackend"]
    read = disk.batched_get

    def too_few(asked):
        objs = read(asked)
        release_all(objs[1:])
        return objs[:1]

    monkeypatch.setattr(disk, "batched_get", too_few)
    assert manager.prefetch(manager.contains_prefix(keys)) == 3
    got: list = []
    reader = threading.Thread(target=lambda: got.append(manager.get_prefix(keys)), daemon=True)
    reader.start()
    reader.join(WRITE_WAIT)
    assert not reader.is_alive() and got == [[]]
