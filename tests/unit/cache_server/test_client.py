"""`CacheServerClient` in this process against a real `lmcache cache-server` (its ipc socket and
shared memory): a request the server refuses as malformed is a miss, not an outage, and another
thread's detach while a reply's slots are being made leaves them readable, never an exception."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.cache_server.client import CacheServerClient
from lmcache.config import LMCacheEngineMetadata
from tests.helpers.servers import REPO, CacheServerProcess
from tests.unit.cache_server.test_cache_server import RAW_KEY, no_segment_left  # noqa: F401 - autouse

KEY = CacheEngineKey.from_string(RAW_KEY)
SHAPE = torch.Size([2, 2, 8, 8])  # one chunk of the test model, bf16
METADATA = LMCacheEngineMetadata("test-model", 1, 0, "vllm", torch.bfloat16, (2, 2, 8, 2, 4))


@pytest.fixture
def client(tmp_path):
    """A client attached to a server whose L1 holds one chunk of ones for KEY."""
    server = CacheServerProcess(f"ipc://{tmp_path}/cache.sock", heartbeat=30).start()
    c = CacheServerClient(server.url, METADATA, timeout=5)
    try:
        assert c.attached
        (slot,) = c.allocate_many([SHAPE], torch.bfloat16)
        slot.tensor.fill_(1)
        assert c.commit([KEY], [slot]) == 1
        slot.ref_count_down()
        yield c
    finally:
        c.close()
        server.stop()


def test_a_request_refused_as_malformed_is_a_miss_and_the_engine_stays_attached(client):
    larger_than_l1 = torch.Size([2, 2, 8, 8 * (client.attachment.arena.size // 512 + 1)])
    assert client.allocate_many([SHAPE, larger_than_l1], torch.bfloat16) == []
    assert client.attached
    assert client.counts.get("refused") == 1 and client.faults.counts()["failures"] == 0
    (got,) = client.get([KEY])  # and the next request is served
    assert bool((got.tensor == 1).all())
    got.ref_count_down()


def detach_after_the_reply(client, monkeypatch) -> None:
    """Another engine thread's exchange fails (and detaches the client) right after this thread's
    reply arrived, before its slots are made: a race no real server can be made to hit on cue."""
    request = client._request

    def then_detach(op, fields):
        answered = request(op, fields)

        def other_thread():
            with client._io:
                client._detach()

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        return answered

    monkeypatch.setattr(client, "_request", then_detach)


def test_a_get_racing_another_threads_detach_gets_readable_chunks(client, monkeypatch):
    attachment = client.attachment
    detach_after_the_reply(client, monkeypatch)
    (got,) = client.get([KEY])
    assert not client.attached
    assert bool((got.tensor == 1).all())  # the detached arena stays mapped while a chunk views it
    got.ref_count_down()
    assert attachment.live == 0 and attachment.arena._closed  # then it is unmapped


def test_a_reserve_racing_another_threads_detach_gets_writable_slots_that_are_never_committed(
        client, monkeypatch):
    attachment = client.attachment
    detach_after_the_reply(client, monkeypatch)
    (slot,) = client.allocate_many([SHAPE], torch.bfloat16)
    slot.tensor.fill_(2)
    assert client.commit([KEY], [slot]) == 0  # a slot of an old attachment
    slot.ref_count_down()
    assert attachment.live == 0 and attachment.arena._closed


def test_an_engine_whose_hello_the_server_refuses_serves_misses_and_keeps_asking(tmp_path):
    url = f"ipc://{tmp_path}/cache.sock"
    late = CacheServerClient(url, METADATA, timeout=5, name="x" * 300)  # before its server starts
    server = CacheServerProcess(url, heartbeat=30).start()
    try:
        early = CacheServerClient(url, METADATA, timeout=5, name="x" * 300)  # refused: no exception
        assert not early.attached and early.counts.get("refused") == 1
        early.close()
        deadline = time.monotonic() + 10
        while late.counts.get("refused") < 2 and time.monotonic() < deadline:  # once every heartbeat
            time.sleep(0.05)
        assert late.counts.get("refused") >= 2 and not late.attached and late._beats.is_alive()
        assert late.get([KEY]) == [] and late.allocate_many([SHAPE], torch.bfloat16) == []
    finally:
        late.close()
        server.stop()


def test_a_request_failing_on_a_server_that_went_away_is_counted_once(tmp_path):
    server = CacheServerProcess(f"ipc://{tmp_path}/cache.sock", heartbeat=30).start()  # no heartbeat
    c = CacheServerClient(server.url, METADATA, timeout=5)
    try:
        assert c.attached
        server.stop()
        assert c.get([KEY]) == []  # failed (or skipped, had the client noticed the drop first)
        counted = c.faults.counts()
        assert counted["failures"] + counted["skipped"] == 1, counted
        assert c.get([KEY]) == [] and not c.attached
        counted = c.faults.counts()
        assert counted["failures"] + counted["skipped"] == 2, counted
    finally:
        c.close()


OUT_OF_DESCRIPTORS = """
import os, resource, sys, threading, time
from lmcache.cache_server.client import CacheServerClient
from lmcache.cache_server.server import CacheServer
from tests.unit.cache_server.test_client import METADATA
url = sys.argv[1]
client = CacheServerClient(url, METADATA, timeout=0.2)  # no server yet: it looks every second
time.sleep(0.3)  # between two looks: no socket of it open
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
lowest = os.open("/dev/null", os.O_RDONLY)
os.close(lowest)
resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # no descriptor more, for two looks
time.sleep(2.5)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
server = CacheServer(url, 1 << 20, heartbeat=30)
serving = threading.Thread(target=server.serve_forever)
serving.start()
try:
    deadline = time.monotonic() + 10
    while not client.attached and time.monotonic() < deadline:
        time.sleep(0.05)
    attached = client.attached
    closing = threading.Thread(target=client.close, daemon=True)
    closing.start()
    closing.join(10)
    print(attached, not closing.is_alive(), flush=True)
finally:
    server.stop()
    serving.join()
    server.close()
"""


def test_an_engine_out_of_file_descriptors_for_a_while_attaches_once_it_has_them_again(tmp_path):
    out = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS, f"ipc://{tmp_path}/cache.sock"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.split() == ["True", "True"], out.stderr  # attached, and closed
