"""RemoteBackend logic against an in-process store whose faults the test controls (a real server's
timeouts and per-node failures are exercised in tests/integration/tiers)."""

import logging
import socket
import threading
from typing import BinaryIO

import pytest
import torch

from lmcache.config import LMCacheEngineConfig
from lmcache.observability import LOG_INTERVAL
from lmcache.storage_backend.connectors.base import RemoteConnector
from lmcache.storage_backend.remote_backend import RemoteBackend
from lmcache.storage_backend.serde import create_serde
from tests.helpers import WRITE_WAIT
from tests.helpers.clock import ManualClock
from tests.helpers.servers import free_port


class FlakyStore(RemoteConnector):
    """A dict; while `down` holds a key's domain ("even"/"odd" by last hex digit), calls raise."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.down: set[str] = set()
        self.calls = 0
        self.clock = ManualClock()  # the backend's (the test steps time past a backoff delay)

    def failure_domain(self, key: str) -> str:
        return "odd" if int(key.split("@")[4][-1], 16) % 2 else "even"

    def _check(self, key: str) -> None:
        self.calls += 1
        if self.failure_domain(key) in self.down:
            raise TimeoutError(f"timed out ({key[-4:]})")

    def get(self, key):
        self._check(key)
        return self.data.get(key)

    def put(self, key, parts):
        self._check(key)
        self.data[key] = b"".join(bytes(p) for p in parts)

    def exists(self, key):
        self._check(key)
        return key in self.data

    def delete(self, key):
        self._check(key)
        return self.data.pop(key, None) is not None


@pytest.fixture
def remote(meta, allocator):
    store = FlakyStore()
    config = LMCacheEngineConfig.from_defaults(remote_url="lm://127.0.0.1:1?backoff=0.05&max_backoff=0.05")
    backend = RemoteBackend(config, meta, allocator.allocate, connector=store, clock=store.clock)
    yield backend, store
    backend.close()


def put(backend, k, obj):
    backend.submit_put_task(k, obj)
    assert backend.puts.flush(WRITE_WAIT)


def test_round_trip_and_batched_get(remote, make_obj, key):
    backend, _ = remote
    objs = [make_obj(i) for i in range(3)]
    for i, o in enumerate(objs):
        put(backend, key(i), o)
    assert backend.contains(key(1)) and not backend.contains(key(7))
    got = backend.batched_get([key(0), key(7), key(2)])
    assert got[1] is None
    assert torch.equal(got[0].tensor, objs[0].tensor) and torch.equal(got[2].tensor, objs[2].tensor)


def test_a_failing_store_is_a_miss_warned_once_per_incident_and_retried_after_backoff(remote, make_obj, key,
                                                                                       caplog):
    backend, store = remote
    put(backend, key(2), make_obj(2))
    store.down = {"even", "odd"}
    with caplog.at_level(logging.WARNING):
        for _ in range(20):
            assert backend.get_blocking(key(2)) is None and not backend.contains(key(2))
    warnings = [r for r in caplog.records if "treated as a cache miss" in r.message]
    assert len(warnings) == 1 and store.calls < 10  # backing off: most calls never reach the store
    assert not backend.available and backend.num_skipped > 0
    store.down = set()
    store.clock.advance(0.05)
    got = backend.get_blocking(key(2))
    assert got is not None and backend.available
    store.down = {"even"}
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        backend.get_blocking(key(2))  # a new incident within LOG_INTERVAL of the warning: a debug line
        assert not [r for r in caplog.records if "treated as a cache miss" in r.message]
        store.down = set()
        store.clock.advance(LOG_INTERVAL)
        assert backend.get_blocking(key(2)) is not None
        store.down = {"even"}
        backend.get_blocking(key(2))  # the interval has passed: it warns, counting the one unlogged
    (warning,) = [r for r in caplog.records if "treated as a cache miss" in r.message]
    assert "1 more incidents" in warning.message


def test_write_faults_are_counted_once_as_failed_puts_never_as_written(remote, make_obj, key):
    """The node's failure domain counts the fault (``failures``, then ``skipped`` while backing
    off); the put queue counts the put as failed or not attempted, never as written."""
    backend, store = remote
    put(backend, key(0), make_obj(0))
    written = backend.stats().counters
    assert written["puts_written"] == 1 and written["bytes_written"] > 0
    store.down = {"even", "odd"}
    for i in range(1, 5):
        put(backend, key(i), make_obj(i))
    after = backend.stats().counters
    assert (after["puts_written"], after["bytes_written"]) == (1, written["bytes_written"])
    assert after["failures"] == 2 and after["skipped"] == 2  # one failure per domain, then backoff
    assert after["puts_failed"] == 2 and after["puts_dropped"] == 2
    store.down = set()
    store.clock.advance(0.05)
    put(backend, key(5), make_obj(5))
    assert backend.stats().counters["puts_written"] == 2 and store.data


def test_one_failing_domain_does_not_disable_the_others(remote, make_obj, key):
    backend, store = remote
    for i in range(4):
        put(backend, key(i), make_obj(i))
    store.down = {"odd"}
    hits = [backend.get_blocking(key(i)) is not None for i in range(4)]
    assert hits == [True, False, True, False]


def test_puts_to_a_failing_store_are_skipped_not_raised(remote, make_obj, key):
    backend, store = remote
    store.down = {"even", "odd"}
    obj = make_obj(1)
    put(backend, key(1), obj)
    assert obj.get_ref_count() == 1 and store.data == {}


def test_a_corrupt_value_is_a_miss_and_is_deleted(remote, make_obj, key):
    backend, store = remote
    put(backend, key(1), make_obj(1))
    (rk,) = store.data
    store.data[rk] = store.data[rk][:-10]
    assert backend.get_blocking(key(1)) is None and rk not in store.data and backend.num_corrupt == 1


def test_a_put_is_one_set_without_an_exists_first(remote, make_obj, key):
    backend, store = remote
    put(backend, key(1), make_obj(1))
    assert store.calls == 1 and len(store.data) == 1  # the put itself, nothing else


def test_namespace_prefixes_every_key(meta, allocator, make_obj, key):
    store = FlakyStore()
    config = LMCacheEngineConfig.from_defaults(remote_url="lm://127.0.0.1:1?namespace=team-a")
    backend = RemoteBackend(config, meta, allocator.allocate, connector=store)
    put(backend, key(1), make_obj(1))
    assert list(store.data) == ["team-a:" + key(1).to_string()]
    backend.close()


def test_the_remote_tier_reports_what_this_process_wrote_deleted_and_found_corrupt(meta, allocator, make_obj,
                                                                                    key):
    from lmcache.storage_backend.events import EventKind, RemovalReason

    store = FlakyStore()
    config = LMCacheEngineConfig.from_defaults(remote_url="lm://127.0.0.1:1?namespace=ns:x")
    backend = RemoteBackend(config, meta, allocator.allocate, connector=store)
    for i in range(3):
        put(backend, key(i), make_obj(i))
    assert backend.remove(key(0)) and not backend.remove(key(0))
    rk = "ns:x:" + key(1).to_string()
    store.data[rk] = store.data[rk][:-10]
    assert backend.get_blocking(key(1)) is None
    store.down = {"even", "odd"}
    put(backend, key(3), make_obj(3))  # a failed write is not reported
    events = [(e.kind, e.keys, e.reason) for e in backend.take_events()]
    assert sorted(events[:3], key=str) == [(EventKind.STORED, (key(i),), None) for i in range(3)]
    assert events[3:] == [(EventKind.REMOVED, (key(0),), RemovalReason.DELETED),
                          (EventKind.REMOVED, (key(1),), RemovalReason.CORRUPT)]
    assert backend.medium == "STORAGE"
    backend.close()


@pytest.mark.parametrize("url, shown", [
    ("redis://user:S3cret@127.0.0.1:{port}/0", "redis://user:***@127.0.0.1:{port}/0"),
    ("lm://127.0.0.1:{port}?auth_token=S3cret&namespace=a", "lm://127.0.0.1:{port}?namespace=a"),
])
def test_the_stores_password_and_auth_token_are_never_logged(url, shown, meta, allocator, make_obj, key,
                                                            caplog):
    port = free_port()  # nothing listens: the calls fail, and the failure names the store
    config = LMCacheEngineConfig.from_defaults(remote_url=url.format(port=port), remote_timeout=0.5)
    backend = RemoteBackend(config, meta, allocator.allocate)
    with caplog.at_level(logging.DEBUG):
        assert not backend.contains(key(1))
        put(backend, key(1), make_obj(1))
    backend.close()
    assert shown.format(port=port) in caplog.text and "S3cret" not in caplog.text


HELLO_REPLY = b"%1\r\n$5\r\nproto\r\n:3\r\n"


class CutAfterValueServer:
    """A RESP server that answers HELLO as RESP3, any other command OK, and a GET with `value`,
    cutting the connection before the value's trailing CRLF (a real server cannot stop there)."""

    def __init__(self, value: bytes) -> None:
        self.value = value
        self.gets = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn, conn.makefile("rb") as reader:
                while (command := _resp_command(reader)) is not None:
                    if command[0].upper() == b"GET":
                        self.gets += 1
                        conn.sendall(b"$%d\r\n" % len(self.value) + self.value)
                        break
                    conn.sendall(HELLO_REPLY if command[0].upper() == b"HELLO" else b"+OK\r\n")

    def close(self) -> None:
        self.sock.close()


def _resp_command(reader: BinaryIO) -> list[bytes] | None:
    """The next RESP command (an array of bulk strings) from `reader`; None at the end."""
    line = reader.readline()
    if not line:
        return None
    args = []
    for _ in range(int(line[1:])):
        length = int(reader.readline()[1:])
        args.append(reader.read(length + 2)[:-2])
    return args


def test_a_connection_lost_after_a_value_before_its_terminator_leaks_no_buffer(meta, allocator, make_obj,
                                                                               key):
    obj = make_obj(1)
    serializer, _ = create_serde("naive", LMCacheEngineConfig.from_defaults(), meta)
    server = CutAfterValueServer(b"".join(bytes(p) for p in serializer.to_parts(obj.tensor)))
    obj.ref_count_down()
    url = f"redis://127.0.0.1:{server.port}"
    backend = RemoteBackend(LMCacheEngineConfig.from_defaults(remote_url=url, remote_timeout=2), meta,
                            allocator.allocate)
    try:
        assert backend.get_blocking(key(1)) is None  # the value arrived, its reply did not: a miss
        assert server.gets == 1 and backend.stats().counters["failures"] == 1
    finally:
        backend.close()
        server.close()
    assert allocator.used_bytes == 0
