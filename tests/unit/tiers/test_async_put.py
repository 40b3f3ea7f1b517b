import threading

import pytest

from lmcache.failures import FailureDomains, NoRoom, TooLarge
from lmcache.storage_backend.async_put import AsyncPutQueue
from tests.helpers import WRITE_WAIT
from tests.helpers.clock import ManualClock


class GatedWriter:
    """A write function that blocks until `gate` is set and records what it wrote."""

    def __init__(self, fail: bool = False) -> None:
        self.gate = threading.Event()
        self.written: list = []
        self.fail = fail

    def __call__(self, key, obj) -> None:
        self.gate.wait(10)
        if self.fail:
            raise OSError("disk full")
        self.written.append((key, obj.tensor.clone()))


def test_put_holds_a_reference_until_written_then_releases_it(make_obj, key):
    w = GatedWriter()
    q = AsyncPutQueue("t", w)
    obj = make_obj(1)
    q.submit(key(1), obj)
    assert obj.get_ref_count() == 2 and q.contains(key(1))
    w.gate.set()
    assert q.flush(WRITE_WAIT)
    assert obj.get_ref_count() == 1 and not q.contains(key(1))
    assert q.num_written == 1 and len(w.written) == 1
    q.close()


def test_a_key_in_flight_is_not_queued_twice(make_obj, key):
    w = GatedWriter()
    q = AsyncPutQueue("t", w)
    obj = make_obj(1)
    f1 = q.submit(key(1), obj)
    f2 = q.submit(key(1), make_obj(2))
    assert f1 is f2 and len(q) == 1
    w.gate.set()
    q.close()
    assert len(w.written) == 1


def test_a_full_queue_drops_and_counts_instead_of_blocking(make_obj, key, caplog):
    w = GatedWriter()
    q = AsyncPutQueue("t", w, num_workers=1, max_pending=2)
    objs = [make_obj(i) for i in range(4)]
    with caplog.at_level("INFO", logger="lmcache.storage_backend.async_put"):
        futures = [q.submit(key(i), o) for i, o in enumerate(objs)]
    assert futures[2] is None and futures[3] is None and q.num_dropped == 2
    full = [r for r in caplog.records if "queue was full" in r.getMessage()]
    assert len(full) == 1 and full[0].levelname == "INFO"  # capacity: one summary line, not a warning
    assert [o.get_ref_count() for o in objs] == [2, 2, 1, 1]  # dropped puts hold nothing
    w.gate.set()
    q.close()
    assert [o.get_ref_count() for o in objs] == [1, 1, 1, 1]


def test_get_pending_serves_the_object_being_written(make_obj, key):
    w = GatedWriter()
    q = AsyncPutQueue("t", w)
    obj = make_obj(1)
    q.submit(key(1), obj)
    got = q.get_pending(key(1))
    assert got is obj and obj.get_ref_count() == 3
    got.ref_count_down()
    assert q.get_pending(key(2)) is None
    w.gate.set()
    q.close()


def test_failed_write_is_counted_logged_once_and_releases_the_reference(make_obj, key, caplog):
    w = GatedWriter(fail=True)
    w.gate.set()
    clock = ManualClock()
    q = AsyncPutQueue("t", w, num_workers=1, faults=FailureDomains(str, 0.5, 4.0, clock=clock))
    objs = [make_obj(i) for i in range(4)]
    for i, o in enumerate(objs):
        if i == 3:
            clock.advance(0.5)  # the backoff delay has passed: tried again
        q.submit(key(i), o)
        assert q.flush(WRITE_WAIT)
    assert q.num_failed == 2 and q.num_dropped == 2  # tried and failed; not tried while backing off
    assert all(o.get_ref_count() == 1 for o in objs)
    assert sum("failed" in r.message for r in caplog.records if r.levelname == "WARNING") == 1
    q.close()


def test_a_write_the_store_has_no_room_for_is_dropped_not_failed_and_nothing_backs_off(make_obj, key, caplog):
    refusals = iter([TooLarge("larger than the store"), NoRoom("pinned"), TooLarge("larger than the store")])

    def refuse(k, obj) -> None:
        raise next(refusals)

    q = AsyncPutQueue("t", refuse, num_workers=1)
    objs = [make_obj(i) for i in range(3)]
    with caplog.at_level("INFO", logger="lmcache.storage_backend.async_put"):
        for i, o in enumerate(objs):  # each one tried: no backoff after the first
            q.submit(key(i), o)
            assert q.flush(WRITE_WAIT)
    assert (q.num_dropped, q.num_too_large, q.num_no_room, q.num_failed, q.num_written) == (3, 2, 1, 0, 0)
    assert q.fault_counts() == {"failures": 0, "skipped": 0}
    assert all(o.get_ref_count() == 1 for o in objs)
    (line,) = [r for r in caplog.records if "no room" in r.getMessage()]
    assert line.levelname == "INFO"  # capacity: one summary line, not a warning
    q.close()


def test_writes_resume_once_the_store_works_again(make_obj, key):
    w = GatedWriter(fail=True)
    w.gate.set()
    clock = ManualClock()
    q = AsyncPutQueue("t", w, num_workers=1, faults=FailureDomains(str, 0.5, 4.0, clock=clock))
    q.submit(key(0), make_obj(0))
    assert q.flush(WRITE_WAIT)
    w.fail = False
    q.submit(key(1), make_obj(1))  # within the backoff: not tried
    assert q.flush(WRITE_WAIT)
    clock.advance(0.5)
    q.submit(key(2), make_obj(2))
    assert q.flush(WRITE_WAIT)
    assert (q.num_failed, q.num_dropped, q.num_written) == (1, 1, 1)
    q.close()


def test_close_waits_boundedly_then_cancels_queued_writes(make_obj, key):
    w = GatedWriter()
    q = AsyncPutQueue("t", w, num_workers=1, max_pending=8)
    objs = [make_obj(i) for i in range(3)]
    for i, o in enumerate(objs):
        q.submit(key(i), o)
    q.close(timeout=0.2)  # the first write is stuck at the gate; the other two never started
    assert q.num_dropped == 2
    assert [o.get_ref_count() for o in objs] == [2, 1, 1]
    w.gate.set()
    assert q.flush(WRITE_WAIT)
    assert objs[0].get_ref_count() == 1
    assert q.submit(key(9), make_obj(9)) is None  # closed


def test_close_flushes_everything_that_fits_in_the_wait(make_obj, key):
    w = GatedWriter()
    w.gate.set()
    q = AsyncPutQueue("t", w, num_workers=2, max_pending=64)
    for i in range(20):
        o = make_obj(i)
        q.submit(key(i), o)
        o.ref_count_down()
    q.close(timeout=10)
    assert q.num_written == 20 and len(w.written) == 20


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError, match="max_pending"):
        AsyncPutQueue("t", lambda k, o: None, max_pending=0)
