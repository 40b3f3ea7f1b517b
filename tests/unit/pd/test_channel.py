"""The KV channel between two engines (sender = a prefill instance's, receiver = a decode
instance's), over TCP and over NIXL: what arrives is served exactly, a full buffer makes the
sender wait a bounded time and skip, broken or foreign transfers are never visible."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import resource
import socket
import struct
import time
from collections.abc import Iterator

import pytest
import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.memory_management import release_all
from lmcache.pd import nixl_agent, receiver
from lmcache.pd.sender import PDSender
from lmcache.pd.wire import Chunk, recv_message, send_message
from lmcache.storage_backend import pd_backend
from lmcache.storage_backend.events import EventKind, RemovalReason
from tests.helpers.paged_kv import PagedKV, build_engine
from tests.helpers.servers import free_port

CHUNK = 8
CHANNELS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_agent.available(),
                                                                  reason="NIXL is not installed"))]


def chunk_bytes(engine) -> int:
    return engine.gpu_connector.get_shape(CHUNK).numel() * engine.metadata.kv_dtype.itemsize


def receiver_engine(channel="tcp", **cfg):
    cfg.setdefault("pd_buffer_size", 1 << 20)
    cfg.setdefault("pd_peer_init_port", free_port())
    return build_engine(CHUNK, enable_pd=True, pd_role="receiver", transfer_channel=channel, **cfg)


def room_for_two_chunks() -> int:
    probe = build_engine(CHUNK)
    room = 2 * pd_backend.HostMemoryAllocator.aligned_size(chunk_bytes(probe))
    probe.close()
    return room


def address(engine) -> str:
    return engine.storage_manager.backends["PDBackend"].server.address


def stored(engine, n, seed=0):
    """`n` tokens whose KV `engine` stored, and that KV ([2, L, n, hidden])."""
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed))
    slots = kv.slots_for(n)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    return tokens, kv.tokens_kv(slots)


def loaded(engine, tokens):
    """What `engine` retrieves for `tokens` ([2, L, n, hidden]) and how many tokens it found."""
    kv = PagedKV().empty_like()
    slots = kv.slots_for(len(tokens))
    got = engine.retrieve(tokens, kvcaches=kv.layers, slot_mapping=slots)
    return kv.tokens_kv(slots), int(got.sum())


@pytest.fixture
def pair(request):
    channel = getattr(request, "param", "tcp")
    rx = receiver_engine(channel)
    tx = build_engine(CHUNK, transfer_channel=channel)
    sender = PDSender(tx, tx.config, rank=0)
    yield tx, sender, rx
    sender.close()
    tx.close()
    rx.close()


@pytest.mark.parametrize("pair", CHANNELS, indirect=True)
def test_a_sent_prompt_is_a_full_hit_with_the_same_kv_at_the_receiver(pair):
    tx, sender, rx = pair
    tokens, kv = stored(tx, 36)  # 4 full chunks + a 4-token tail
    assert rx.lookup(tokens) == 0
    result = sender.send(address(rx), tokens)
    nixl = tx.config.transfer_channel == "nixl"
    assert sender.channel == ("nixl" if nixl else "tcp")
    assert result.nixl == (result.sent if nixl else 0)  # the arena is registered: nothing inline
    assert result.sent == 36 * chunk_bytes(tx) // CHUNK and result.skipped == 0 and len(result.chunks) == 5
    assert rx.lookup(tokens) == 36
    got, n = loaded(rx, tokens)
    assert n == 36 and torch.equal(got, kv)
    rx.check_integrity()  # handed over into the receiver's hot tier; nothing left reserved
    tier = rx.storage_manager.backends["PDBackend"]
    assert tier.stats().gauges == {"chunks": 0, "bytes_used": 0, "reserved": 0}


def busy_cores(seconds: float) -> float:
    """The cores this process kept busy over the next `seconds`."""
    start = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    end = resource.getrusage(resource.RUSAGE_SELF)
    return (end.ru_utime + end.ru_stime - start.ru_utime - start.ru_stime) / seconds


@pytest.mark.parametrize("pair", CHANNELS, indirect=True)
def test_both_sides_stay_idle_between_transfers(pair):
    tx, sender, rx = pair
    tokens, _ = stored(tx, 32)
    assert sender.send(address(rx), tokens).sent > 0  # agents created, peers known, buffers registered
    assert busy_cores(1.0) < 0.3  # NIXL's own progress thread would keep a core busy (1.0)


@pytest.mark.parametrize("pair", CHANNELS, indirect=True)
def test_kv_the_receiver_holds_is_not_sent_again(pair):
    tx, sender, rx = pair
    tokens, _ = stored(tx, 32)
    assert sender.send(address(rx), tokens[:16]).sent == 2 * chunk_bytes(tx)
    again = sender.send(address(rx), tokens)
    assert again.had == 2 * chunk_bytes(tx) and again.sent == 2 * chunk_bytes(tx)
    assert rx.lookup(tokens) == 32


def test_without_a_hot_tier_the_receive_buffer_hands_its_object_over_and_frees_it():
    rx = receiver_engine(local_cpu=False)
    tx = build_engine(CHUNK)
    sender = PDSender(tx, tx.config, rank=0)
    try:
        tokens, kv = stored(tx, 24)
        sender.send(address(rx), tokens)
        tier = rx.storage_manager.backends["PDBackend"]
        assert tier.stats().gauges["chunks"] == 3
        got, n = loaded(rx, tokens)
        assert n == 24 and torch.equal(got, kv)
        assert tier.stats().gauges == {"chunks": 0, "bytes_used": 0, "reserved": 0}
        assert rx.lookup(tokens) == 0  # handed over once
    finally:
        sender.close()
        tx.close()
        rx.close()


def test_the_receive_buffer_reports_what_arrives_and_what_it_hands_over(monkeypatch):
    rx = receiver_engine(local_cpu=False)
    tx = build_engine(CHUNK)
    sender = PDSender(tx, tx.config, rank=0)
    tier = rx.storage_manager.backends["PDBackend"]
    seen = []
    take = tier.take_events

    def recorded():
        events = take()
        seen.extend(events)
        return events

    monkeypatch.setattr(tier, "take_events", recorded)  # what the storage manager takes
    try:
        tokens, _ = stored(tx, 24)
        sender.send(address(rx), tokens)
        assert loaded(rx, tokens)[1] == 24
        arrived = [k for e in seen if e.kind is EventKind.STORED for k in e.keys]
        handed = [k for e in seen if e.reason is RemovalReason.HANDED_OVER for k in e.keys]
        assert len(arrived) == 3 and handed == arrived and {e.tier for e in seen} == {"PDBackend"}
    finally:
        sender.close()
        tx.close()
        rx.close()


def test_a_full_buffer_makes_the_sender_wait_a_bounded_time_then_skip_the_rest(caplog):
    rx = receiver_engine(pd_buffer_size=room_for_two_chunks())
    tx = build_engine(CHUNK, pd_send_timeout=0.3)
    sender = PDSender(tx, tx.config, rank=0)
    try:
        tokens, kv = stored(tx, 40)
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO):
            first = sender.send(address(rx), tokens)
        waited = time.monotonic() - t0
        assert 0.3 <= waited < 2.0
        assert first.sent == 2 * chunk_bytes(tx) and first.skipped == 3 * chunk_bytes(tx)
        # capacity, not a failure: a summary line, counted as skipped bytes, no fault
        assert [r.levelname for r in caplog.records if r.name == "lmcache.pd.sender"] == ["INFO"]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        counted = tx.stats.snapshot()
        assert counted["pd_skipped_bytes"] == first.skipped and counted["pd_send_failures"] == 0
        assert rx.lookup(tokens) == 16  # the prefix that arrived
        rx.check_integrity()
        got, n = loaded(rx, tokens)  # the decoder takes it: room again
        assert n == 16 and torch.equal(got[:, :, :16], kv[:, :, :16])
        second = sender.send(address(rx), tokens)
        assert second.had == 2 * chunk_bytes(tx) and second.sent == 2 * chunk_bytes(tx)
        assert rx.lookup(tokens) == 32
    finally:
        sender.close()
        tx.close()
        rx.close()


def test_chunks_nobody_claimed_make_room_after_their_time(monkeypatch):
    rx = receiver_engine(pd_buffer_size=room_for_two_chunks())
    tx = build_engine(CHUNK, pd_send_timeout=0.0)
    sender = PDSender(tx, tx.config, rank=0)
    try:
        old, _ = stored(tx, 16, seed=1)
        new, _ = stored(tx, 16, seed=2)
        assert sender.send(address(rx), old).sent == 2 * chunk_bytes(tx)
        assert sender.send(address(rx), new).sent == 0  # full, and the old ones are fresh
        monkeypatch.setattr(pd_backend, "UNCLAIMED_TTL", 0.0)
        assert sender.send(address(rx), new).sent == 2 * chunk_bytes(tx)
        rx.check_integrity()
        assert rx.lookup(old) == 0 and rx.lookup(new) == 16
        assert rx.storage_manager.backends["PDBackend"].stats().counters["expired"] == 2
    finally:
        sender.close()
        tx.close()
        rx.close()


def test_kv_of_another_model_is_refused_and_not_offered_again():
    rx = receiver_engine()
    tx = build_engine(CHUNK, pd_send_timeout=5.0)
    tx.metadata.model_name = "other-model"
    tx.token_database = type(tx.token_database)(tx.config, tx.metadata)
    sender = PDSender(tx, tx.config, rank=0)
    try:
        tokens, _ = stored(tx, 16)
        t0 = time.monotonic()
        result = sender.send(address(rx), tokens)
        assert time.monotonic() - t0 < 1.0  # refused, not waited for
        assert result.sent == 0 and result.skipped == 2 * chunk_bytes(tx)
        assert rx.storage_manager.backends["PDBackend"].stats().counters["foreign"] == 2
    finally:
        sender.close()
        tx.close()
        rx.close()


def test_a_dead_receiver_costs_one_failure_then_is_backed_off():
    tx = build_engine(CHUNK)
    sender = PDSender(tx, tx.config, rank=0)
    try:
        tokens, _ = stored(tx, 16)
        dead = f"127.0.0.1:{free_port()}"
        assert sender.send(dead, tokens).sent == 0
        assert sender.send(dead, tokens).sent == 0
        assert sender._faults.counts() == {"failures": 1.0, "skipped": 1.0}
        with pytest.raises(ValueError, match="host:port"):
            sender.send("nowhere", tokens)
        tx.check_integrity()  # every object the sends held was released
    finally:
        sender.close()
        tx.close()


def test_a_receiver_that_restarted_on_its_port_gets_the_next_send():
    rx = receiver_engine()
    port = rx.config.pd_peer_init_port
    tx = build_engine(CHUNK)
    sender = PDSender(tx, tx.config, rank=0)
    try:
        first, _ = stored(tx, 16, seed=1)
        assert sender.send(address(rx), first).sent == 2 * chunk_bytes(tx)
        rx.close()
        rx = receiver_engine(pd_peer_init_port=port)
        second, kv = stored(tx, 16, seed=2)
        assert sender.send(address(rx), second).sent == 2 * chunk_bytes(tx)  # not lost to the old connection
        got, n = loaded(rx, second)
        assert n == 16 and torch.equal(got, kv)
        assert sender._faults.counts()["failures"] == 0
    finally:
        sender.close()
        tx.close()
        rx.close()


def test_a_receiver_that_goes_down_is_one_failure_and_one_warning_then_skipped_until_it_is_back(caplog):
    rx = receiver_engine()
    port, at = rx.config.pd_peer_init_port, address(rx)
    tx = build_engine(CHUNK)
    sender = PDSender(tx, tx.config, rank=0)
    up = True

    def faults() -> tuple[float, float]:
        counted = tx.stats.snapshot()  # the engine's stats: what its metrics are made from
        return counted["pd_send_failures"], counted["pd_send_skipped"]

    try:
        tokens, _ = stored(tx, 16)
        assert sender.send(at, tokens).sent == 2 * chunk_bytes(tx) and faults() == (0, 0)
        with caplog.at_level(logging.INFO):
            rx.close()
            up = False
            assert [sender.send(at, tokens).sent for _ in range(3)] == [0, 0, 0]
            assert faults() == (1, 2)  # one failed send; the next two not tried (backing off)
            rx, up = receiver_engine(pd_peer_init_port=port), True
            time.sleep(0.6)  # past the first backoff delay (0.5 s)
            assert sender.send(at, tokens).sent == 2 * chunk_bytes(tx) and faults() == (1, 2)
            rx.close()  # down again within a minute: a flapping incident
            up = False
            assert sender.send(at, tokens).sent == 0 and faults() == (2, 2)
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and f"the KV receiver at {at} failed" in warned[0], warned
        assert [r.getMessage() for r in caplog.records
                if r.levelno == logging.INFO and r.name == "lmcache.failures"] == [
                    f"the KV receiver at {at} works again"]
        assert tx.stats.interval()["counters"]["pd_send_failures"] == 2  # shipped to vLLM's metrics too
        tx.check_integrity()
    finally:
        sender.close()
        tx.close()
        if up:
            rx.close()


def _frame(message) -> bytes:
    return _raw_frame(json.dumps(message).encode())


def _raw_frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def offer_of(engine, tokens) -> list[dict]:
    """The `offer` entries of the chunks `engine` holds for `tokens`."""
    held = engine.held_prefix(tokens)
    release_all([obj for _, obj in held])
    return [{"key": key.to_string(), "shape": list(obj.metadata.shape), "dtype": "bfloat16", "fmt": "KV_BLOB"}
            for key, obj in held]


@contextlib.contextmanager
def raw_sender(rx) -> Iterator[socket.socket]:
    """A connection to `rx`'s KV channel, past its `hello` (TCP)."""
    host, port = address(rx).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        send_message(s, {"op": "hello"})
        assert recv_message(s)["channel"] == "tcp"
        yield s


def nothing_held(rx, within: float = 5.0) -> dict:
    """The receive buffer's gauges once it holds and reserves nothing (or after `within` s)."""
    tier = rx.storage_manager.backends["PDBackend"]
    deadline = time.monotonic() + within
    while any(tier.stats().gauges.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return tier.stats().gauges


def test_a_transfer_that_breaks_midway_is_never_visible_and_frees_its_room():
    rx = receiver_engine()
    tx = build_engine(CHUNK)
    try:
        tokens, _ = stored(tx, 16)
        with raw_sender(rx) as s:
            send_message(s, {"op": "offer", "chunks": offer_of(tx, tokens)})
            assert all(isinstance(slot, dict) for slot in recv_message(s)["slots"])
            send_message(s, {"op": "written", "inline": [0, 1]})
            s.sendall(b"\0" * (chunk_bytes(tx) + 10))  # the first chunk and a bit of the second
        assert nothing_held(rx) == {"chunks": 0, "bytes_used": 0, "reserved": 0}
        assert rx.lookup(tokens) == 0
    finally:
        tx.close()
        rx.close()


def test_a_sender_that_stalls_after_its_offer_loses_its_reservations_and_others_get_the_chunks(
        pair, monkeypatch):
    monkeypatch.setattr(receiver, "NOTIF_TIMEOUT", 0.3)  # how long an offer may wait for its `written`
    tx, sender, rx = pair
    tokens, _ = stored(tx, 16)
    with raw_sender(rx) as stalled:  # neither writes nor closes: a hung prefill process
        send_message(stalled, {"op": "offer", "chunks": offer_of(tx, tokens)})
        assert all(isinstance(slot, dict) for slot in recv_message(stalled)["slots"])
        answer = recv_message(stalled)
        assert answer is not None and answer["ok"] is False and "written" in answer["error"]
        assert nothing_held(rx) == {"chunks": 0, "bytes_used": 0, "reserved": 0}
        assert sender.send(address(rx), tokens).sent == 2 * chunk_bytes(tx)
    assert rx.lookup(tokens) == 16


def test_a_sender_that_stalls_within_a_frame_is_cut_off_and_an_idle_one_is_not(pair, monkeypatch):
    """A frame's length announces its buffer (up to 16 MiB); its bytes must follow within
    FRAME_TIMEOUT. Between frames a connection may idle for as long as it likes."""
    monkeypatch.setattr(receiver, "FRAME_TIMEOUT", 0.5)
    tx, sender, rx = pair
    with raw_sender(rx) as stalled, raw_sender(rx) as idle:
        stalled.sendall(struct.pack("<I", 8 << 20) + b'{"op": ')  # and nothing more
        stalled.settimeout(10)
        answer = recv_message(stalled)
        assert answer is not None and answer["ok"] is False and "did not arrive" in answer["error"]
        assert recv_message(stalled) is None  # closed
        time.sleep(1.0)  # twice the frame timeout, between frames
        tokens, _ = stored(tx, 16)
        send_message(idle, {"op": "offer", "chunks": offer_of(tx, tokens)})
        assert all(isinstance(slot, dict) for slot in recv_message(idle)["slots"])
    assert nothing_held(rx) == {"chunks": 0, "bytes_used": 0, "reserved": 0}  # freed at the close
    assert sender.send(address(rx), tokens).sent == 2 * chunk_bytes(tx)
    assert rx.lookup(tokens) == 16


def test_an_offer_of_a_chunk_larger_than_the_buffer_is_refused_and_reserves_nothing(pair):
    tx, sender, rx = pair
    tokens, _ = stored(tx, 16)
    chunks = offer_of(tx, tokens)
    other = dataclasses.replace(CacheEngineKey.from_string(chunks[0]["key"]), chunk_hash="00ff")
    huge = dict(chunks[0], key=other.to_string(), shape=[2**32, 2**32])  # torch's numel() wraps to 0
    with raw_sender(rx) as s:
        send_message(s, {"op": "offer", "chunks": [*chunks, huge]})
        answer = recv_message(s)
        assert answer is not None and answer["ok"] is False and "receive buffer" in answer["error"]
    assert nothing_held(rx) == {"chunks": 0, "bytes_used": 0, "reserved": 0}
    assert sender.send(address(rx), tokens).sent == 2 * chunk_bytes(tx)  # not answered "have"
    assert rx.lookup(tokens) == 16


def test_a_reservation_that_fails_midway_leaves_nothing_reserved(pair, monkeypatch):
    tx, sender, rx = pair
    tier = rx.storage_manager.backends["PDBackend"]
    allocate = tier.allocator.allocate
    calls = []

    def failing_second(*args):  # no real chunk makes the buffer's allocator raise any more
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("the allocator failed")
        return allocate(*args)

    tokens, _ = stored(tx, 16)
    chunks = [Chunk.from_json(c, tier.buffer.nbytes) for c in offer_of(tx, tokens)]
    monkeypatch.setattr(tier.allocator, "allocate", failing_second)
    with pytest.raises(RuntimeError, match="allocator failed"):
        tier.reserve(chunks)
    monkeypatch.undo()
    assert tier.stats().gauges == {"chunks": 0, "bytes_used": 0, "reserved": 0}
    tier.check_integrity(at_rest=True)
    assert sender.send(address(rx), tokens).sent == 2 * chunk_bytes(tx)
    assert rx.lookup(tokens) == 16


BAD_FRAMES = [
    b"\xff\xff\xff\xff",  # longer than any frame may be
    struct.pack("<I", 5) + b"nope!",  # not JSON
    _frame([1, 2]),  # not an object
    _frame({"op": "launch"}),
    _frame({"op": "offer", "chunks": "all"}),
    _frame({"op": "offer", "chunks": [{"key": "x"}]}),
    _frame({"op": "offer", "chunks": [{"key": "a@b@1@0@h@bfloat16", "shape": [-1], "dtype": "bfloat16",
                                       "fmt": "KV_BLOB"}]}),
    _frame({"op": "written", "inline": [7]}),
    _frame({"op": "written", "inline": [[0]]}),  # not a slot number (nor hashable)
    _raw_frame(b'{"op": "offer", "chunks": [{"key": "a@b@1@0@h@bfloat16", "shape": [Infinity], '
               b'"dtype": "bfloat16", "fmt": "KV_BLOB"}]}'),  # Python's json reads it; int() cannot
    _raw_frame(b'{"op": "offer", "chunks": ' + b"1" * 5000 + b"}"),  # more digits than Python's int takes
    _raw_frame(b"[" * 100_000 + b"]" * 100_000),  # nested deeper than json.loads recurses
]


@pytest.mark.parametrize("frame", BAD_FRAMES)
def test_a_bad_frame_gets_an_error_and_the_receiver_keeps_serving(frame, pair):
    tx, sender, rx = pair
    host, port = address(rx).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(frame)
        answer = recv_message(s)
        assert answer is not None and answer["ok"] is False and answer["error"]
        assert recv_message(s) is None  # and the connection is closed
    tokens, _ = stored(tx, 16)
    assert sender.send(address(rx), tokens).sent == 2 * chunk_bytes(tx)
    assert rx.lookup(tokens) == 16


def test_a_receiver_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match="pd_peer_init_port"):
            build_engine(CHUNK, enable_pd=True, pd_role="receiver", pd_peer_init_port=port)
