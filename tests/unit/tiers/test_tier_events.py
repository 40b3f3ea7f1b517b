"""Tiers report what they store and drop as events; the storage manager takes them after the tier
call returns and tells the tiers that publish local keys (the peer tier) off the tiers' stacks."""

from __future__ import annotations

import gc
import logging
import traceback
import types
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig
from lmcache.memory_management import MemoryObj, MixedMemoryAllocator
from lmcache.storage_backend import registry
from lmcache.storage_backend.abstract_backend import StorageBackendInterface, TierContext
from lmcache.storage_backend.events import EventKind, RemovalReason, TierEvents
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.storage_backend.storage_manager import StorageManager
from tests.helpers import WRITE_WAIT
from tests.unit.tiers.conftest import SHAPE

STORED, REMOVED, CLEARED = EventKind.STORED, EventKind.REMOVED, EventKind.CLEARED


class Recorder(StorageBackendInterface):
    """A tier that publishes local keys, as the peer tier does: it records what it is told and
    the source files of the call stack it was told on."""

    name = "Recorder"
    lookup_order = 99
    is_local = False
    may_fail = False
    publishes_local_keys = True

    def __init__(self) -> None:
        self.told: list[tuple[list[CacheEngineKey], list[CacheEngineKey]]] = []
        self.stack_files: set[str] = set()

    @classmethod
    def create(cls, ctx: TierContext) -> Recorder:
        return cls()

    def local_keys_changed(self, added: Sequence[CacheEngineKey], removed: Sequence[CacheEngineKey]) -> None:
        self.told.append((list(added), list(removed)))
        self.stack_files.update(frame.filename for frame in traceback.extract_stack())

    def contains(self, key: CacheEngineKey) -> bool:
        return False

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False

    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Future | None:
        return None

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return None

    def remove(self, key: CacheEngineKey) -> bool:
        return False

    def close(self) -> None:
        pass


@pytest.fixture
def with_recorder(monkeypatch):
    monkeypatch.setitem(registry._TIERS, Recorder.name, Recorder)


def reaches(root: object, target: object) -> bool:
    """Whether `target` can be reached from `root` through references (closures included;
    classes, modules and functions' globals are not followed)."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if obj is target:
            return True
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            todo.extend(cell.cell_contents for cell in obj.__closure__ or ())
        else:
            todo.extend(gc.get_referents(obj))
    return False


def put_new(sm: StorageManager, k: CacheEngineKey) -> bool:
    obj = sm.allocate(SHAPE, torch.bfloat16)
    if obj is None:
        return False
    sm.put(k, obj)
    obj.ref_count_down()
    return True


def test_events_buffer_keeps_order_and_drops_the_oldest_when_full(key, caplog):
    events = TierEvents("Hot", max_events=2)

    def fill() -> list[tuple]:
        events.stored([key(0)])
        events.removed([], RemovalReason.DELETED)  # nothing removed: no event
        events.removed([key(0)], RemovalReason.EVICTED)
        events.cleared([key(1)])
        events.stored([key(2)])
        return [(e.kind, e.keys, e.reason) for e in events.take()]

    kept = [(CLEARED, (key(1),), None), (STORED, (key(2),), None)]
    with caplog.at_level(logging.WARNING):
        assert fill() == kept and events.num_dropped == 2  # nobody took events before: no warning
        assert not [r for r in caplog.records if "event buffer is full" in r.message]
        assert fill() == kept and events.num_dropped == 4 and events.take() == []
    assert len([r for r in caplog.records if "event buffer is full" in r.message]) == 1


def test_the_hot_tier_reports_stores_evictions_removals_and_clears(meta, key):
    sm = StorageManager(LMCacheEngineConfig.from_defaults(), meta, MixedMemoryAllocator(8 << 10))
    hot = sm.hot
    assert hot is not None
    objs = []
    while (obj := hot.allocate(SHAPE, torch.bfloat16)) is not None:
        objs.append(obj)
    for i, obj in enumerate(objs):
        hot.submit_put_task(key(i), obj)
        obj.ref_count_down()
    n = len(objs)
    extra = hot.allocate(SHAPE, torch.bfloat16)  # the arena is full: evicts key(0)
    assert extra is not None
    extra.ref_count_down()
    assert hot.remove(key(1)) and not hot.remove(key(1))
    hot.clear()
    assert [(e.kind, e.tier, e.keys, e.reason) for e in hot.take_events()] == [
        *[(STORED, "Hot", (key(i),), None) for i in range(n)],
        (REMOVED, "Hot", (key(0),), RemovalReason.EVICTED),
        (REMOVED, "Hot", (key(1),), RemovalReason.DELETED),
        (CLEARED, "Hot", tuple(key(i) for i in range(2, n)), None)]
    assert hot.take_events() == []
    sm.close()


def test_the_disk_tier_reports_a_removal_only_for_a_key_it_held(disk_config, meta, allocator, key, make_obj):
    disk = LocalDiskBackend(disk_config(), meta, allocator.allocate)
    obj = make_obj(1)
    disk.submit_put_task(key(1), obj)
    obj.ref_count_down()
    assert disk.puts.flush(WRITE_WAIT)
    assert not disk.remove(key(2))  # never held
    assert disk.remove(key(1)) and not disk.remove(key(1))
    assert [(e.kind, e.keys, e.reason) for e in disk.take_events()] == [
        (STORED, (key(1),), None), (REMOVED, (key(1),), RemovalReason.DELETED)]
    disk.close()


def test_a_hot_eviction_reaches_the_publishing_tier_after_the_tier_call_returns(with_recorder, meta, key):
    alloc = MixedMemoryAllocator(8 << 10)
    sm = StorageManager(LMCacheEngineConfig.from_defaults(), meta, alloc)
    recorder = sm.backends["Recorder"]
    assert isinstance(recorder, Recorder) and sm.hot is not None
    assert not reaches(sm.hot, sm)  # the hot tier holds no way back into its manager
    n = 0
    while not sm.hot.num_evicted:
        assert put_new(sm, key(n))
        n += 1
    assert recorder.told == [*[([key(i)], []) for i in range(n - 1)], ([], [key(0)]), ([key(n - 1)], [])]
    local_cpu_file = type(sm.hot).__init__.__code__.co_filename
    assert local_cpu_file not in recorder.stack_files  # told by the manager, not from inside the tier
    sm.close()
    assert alloc.used_bytes == 0


def test_disk_evictions_on_the_put_workers_are_taken_on_the_next_call(with_recorder, disk_config, meta, key,
                                                                      make_obj):
    sm = StorageManager(disk_config(), meta, MixedMemoryAllocator(1 << 20))
    recorder, disk = sm.backends["Recorder"], sm.backends["LocalDiskBackend"]
    assert isinstance(recorder, Recorder)
    assert put_new(sm, key(0)) and disk.puts.flush(WRITE_WAIT)
    disk.max_bytes = 2 * disk.used_bytes  # room for two chunk files
    told = list(recorder.told)
    for i in (1, 2):  # written by the disk's put workers alone (no manager call): the second evicts key(0)
        obj = make_obj(i)
        disk.submit_put_task(key(i), obj)
        obj.ref_count_down()
    assert disk.puts.flush(WRITE_WAIT) and disk.num_evicted == 1
    assert recorder.told == told and len(disk.events) >= 3  # the disk's events wait for the manager
    sm.clear("hot")  # the next call takes them: key(0) is now in no local tier, the others on disk
    added, removed = recorder.told[-1]  # the put workers run concurrently: in either order
    assert sorted(added, key=str) == [key(1), key(2)] and removed == [key(0)] and len(disk.events) == 0
    assert sm.stored_locally([key(0), key(1), key(2)]) == [False, True, True]
    sm.close()
