"""vLLM's KV event batches off a real ZMQ PUB socket: decoded, malformed ones counted and skipped, a
subscriber that falls behind loses batches at the high-water mark (counted) instead of memory."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from lmcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from lmcache.router.events import EventSubscriber, decode_batch
from tests.helpers.servers import free_port

STORED = {"type": "BlockStored", "block_hashes": [b"\x01" * 32, 7], "parent_block_hash": None,
          "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}


def batch(*events: dict) -> bytes:
    """A payload as vLLM's encoder writes it (``KVEventBatch`` is array-like, its events tagged maps)."""
    return msgspec.msgpack.encode([time.time(), list(events), None])


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
], ids=["bad-msgpack", "not-a-batch", "unknown-type", "tokens-not-whole-blocks", "negative-token",
        "huge-token", "zero-block-size", "hashes-not-a-list", "medium-not-a-string", "event-not-a-map"])
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


def test_malformed_messages_are_counted_and_skipped_and_gaps_are_missed_batches(publisher):
    sock, endpoint = publisher
    got: list = []
    sub = EventSubscriber(endpoint, got.extend)
    try:
        wait_for(lambda: (send(sock, 0, batch(STORED)), got)[1])  # the slow joiner: until one arrives
        sock.send_multipart([b"", b"short", batch(STORED)])
        send(sock, 1, b"garbage")
        send(sock, 5, batch({"type": "AllBlocksCleared"}))
        # the first wait may have sent several batches: wait for the last one itself
        wait_for(lambda: sub.malformed == 2 and got[-1] == AllBlocksCleared())
        assert sub.missed == 3
    finally:
        sub.close()


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
