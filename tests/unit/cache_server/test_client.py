"""`CacheServerClient` in this process against a real `lmcache cache-server` (its ipc socket and
shared memory): a request the server refuses as malformed is a miss, not an outage, and another
thread's detach while a reply's slots are being made leaves them readable, never an exception."""

from __future__ import annotations

import threading

import pytest
import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.cache_server.client import CacheServerClient
from lmcache.config import LMCacheEngineMetadata
from tests.helpers.servers import CacheServerProcess
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
