"""vLLM's KV event batches off a real ZMQ PUB socket: decoded, malformed ones counted and skipped
(the thread goes on whatever a message holds), a subscriber that falls behind loses batches at the
high-water mark (counted) instead of memory, an endpoint that cannot be subscribed to refused."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from lmcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from lmcache.router.events import EventSubscriber, decode_batch
from lmcache.router.watch import KVWatch
from tests.helpers.servers import free_port

STORED = {"type": "BlockStored", "block_hashes": [b"\x01" * 32, 7], "parent_block_hash": None,
          "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}


def batch(*events: dict) -> bytes:
    """A payload as vLLM's encoder writes it (``KVEventBatch`` is array-like, its events tagged maps)."""
    return msgspec.msgpack.encode([time.time(), list(events), None])


def nested(depth: int = 5000) -> bytes:
    """A batch of one ``BlockStored`` whose extra keys (typed Any) nest `depth` arrays deep."""
    raw = batch({**STORED, "extra_keys": ["MARK", None]})
    mark = raw.index(b"\xa4MARK")
    return raw[:mark] + b"\x91" * depth + b"\xc0" + raw[mark + 5:]


def test_a_batch_decodes_to_its_events():
    events = decode_batch(batch(STORED, {"type": "BlockRemoved", "block_hashes": [7], "medium": None},
                                {"type": "AllBlocksCleared"}))
    assert events == [BlockStored([b"\x01" * 32, 7], None, [1, 2, 3, 4], 2, None, "GPU", None),
                      BlockRemoved([7], None), AllBlocksCleared()]


@pytest.mark.parametrize("payload", [
    b"\xc1", msgspec.msgpack.encode({"ts": 1}), batch({"type": "Nope"}),
    batch({**STORED, "token_ids": [1, 2, 3]}), batch({**STORED, "token_ids": [1, 2, 3, -4]}),
    batch({**STORED, "token_ids": [1, 2, 3, 1 << 40]}), batch({**STORED, "block_size": 0}),
    batch({**STORED, "block_hashes": "x"}), batch({**STORED, "medium": 3}), batch("not a map"),
    batch({**STORED, "extra_keys": [None]}), nested(),
], ids=["bad-msgpack", "not-a-batch", "unknown-type", "tokens-not-whole-blocks", "negative-token",
        "huge-token", "zero-block-size", "hashes-not-a-list", "medium-not-a-string", "event-not-a-map",
        "extra-keys-not-one-per-block", "nested-too-deeply"])
def test_a_malformed_batch_is_a_value_error(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


@pytest.fixture
def publisher():
    sock = zmq.Context.instance().socket(zmq.PUB)
    port = free_port()
    sock.set_hwm(10)
    sock.bind(f"tcp://127.0.0.1:{port}")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(0)


def send(sock: zmq.Socket, seq: int, payload: bytes) -> None:
    sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_malformed_messages_are_counted_and_skipped_and_gaps_between_batches_read_are_missed(publisher):
    """A malformed message's sequence number is not read: one with a far-off number (here 2**64 - 1)
    leaves ``missed`` alone, and the gap around a malformed message counts it as missed."""
    sock, endpoint = publisher
    got: list = []
    sub = EventSubscriber(endpoint, got.extend)
    try:
        wait_for(lambda: (send(sock, 0, batch(STORED)), got)[1])  # the slow joiner: until one arrives
        sock.send_multipart([b"", b"short", batch(STORED)])
        send(sock, 1, b"garbage")
        send(sock, 2**64 - 1, b"\xc1")
        send(sock, 5, batch({"type": "AllBlocksCleared"}))
        # the first wait may have sent several batches: wait for the last one itself
        wait_for(lambda: sub.malformed == 3 and got[-1] == AllBlocksCleared())
        assert sub.missed == 4
    finally:
        sub.close()


def test_the_thread_goes_on_after_a_batch_nested_too_deeply_and_an_apply_that_failed(publisher):
    """msgspec raises RecursionError for a value nested too deeply; a bug in `apply` raises anything:
    each message is counted as malformed and skipped, and the batches after it are applied."""
    sock, endpoint = publisher
    got: list = []

    def apply(events: list) -> None:
        if events == [AllBlocksCleared()]:
            raise RuntimeError("a bug in the index")
        got.extend(events)

    sub = EventSubscriber(endpoint, apply)
    try:
        wait_for(lambda: (send(sock, 0, batch(STORED)), got)[1])
        send(sock, 1, nested())
        send(sock, 2, batch({"type": "AllBlocksCleared"}))
        send(sock, 3, batch({"type": "BlockRemoved", "block_hashes": [7], "medium": None}))
        wait_for(lambda: got[-1] == BlockRemoved([7], None))
        assert (sub.malformed, sub.missed) == (2, 1)  # the nested one: its number was not read
    finally:
        sub.close()


def test_an_endpoint_that_cannot_be_subscribed_to_is_a_value_error_and_leaves_no_thread(publisher):
    _, endpoint = publisher
    with pytest.raises(ValueError, match="cannot subscribe to KV events at 'tcp://\\*:1'"):
        EventSubscriber("tcp://*:1", list)
    before = threading.active_count()
    with pytest.raises(ValueError, match="'tcp://\\*:2'"):
        KVWatch(("http://a", "http://b"), (endpoint, "tcp://*:2"), None)
    wait_for(lambda: threading.active_count() == before)  # a's subscriber was closed


def test_a_subscriber_that_falls_behind_drops_batches_instead_of_growing(publisher):
    sock, endpoint = publisher
    release = threading.Event()
    got: list = []

    def slow(events: list) -> None:
        release.wait(10)
        got.extend(events)

    sub = EventSubscriber(endpoint, slow, hwm=10)
    try:
        wait_for(lambda: (send(sock, 0, batch(STORED)), sub.batches)[1])
        for seq in range(1, 5001):
            send(sock, seq, batch(STORED))  # PUB drops at its own high-water mark rather than block
        send(sock, 5001, batch(STORED))
        release.set()
        time.sleep(0.5)
        send(sock, 5002, batch(STORED))
        wait_for(lambda: sub.batches + sub.missed >= 5002)
        assert sub.missed > 4000 and sub.batches < 1000
    finally:
        release.set()
        sub.close()
