"""`CacheServerClient` against a server that answers garbage: a socket of this test that attaches
the engine as a cache server does (with a real shared arena) and answers every other request as
the test says, since a real server cannot be made to name a slot outside its arena, send a
malformed chunk or refuse a heartbeat. Whatever it answers, the engine gets misses (or the usable
leading part of an answer), the rest of what the server named is given back, and the client keeps
serving and closes."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

from lmcache.cache_server import messages as m
from lmcache.cache_server.client import CacheServerClient
from lmcache.cache_server.shm import SharedArena
from lmcache.memory_management import release_all
from tests.unit.cache_server.test_client import KEY, METADATA, SHAPE, no_segment_left  # noqa: F401 - autouse

ARENA = 1 << 20
CHUNK = math.prod(SHAPE) * 2  # bf16 bytes of SHAPE
Answer = Callable[[dict[str, Any]], dict[str, Any] | None]


class FakeServer:
    """A ROUTER socket on `url` that attaches engines (its `hello` fields overridden by `hello`)
    and answers any other request `answer(request)` (None: no answer); `received` is what came."""

    def __init__(self, url: str, answer: Answer, **hello: Any) -> None:
        self.arena = SharedArena.create(ARENA)
        self.answer = answer
        self.hello = {"session": "s", "engine": "e", "arena": self.arena.name, "arena_size": ARENA,
                      "heartbeat": 30.0, "grown": 0, "texts": False, **hello}
        self.received: list[dict[str, Any]] = []
        self._zmq = zmq.Context()
        self._sock = self._zmq.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(url)
        self.url = url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, body = self._sock.recv_multipart()
            request = json.loads(body)
            self.received.append(request)
            reply = self.hello if request["op"] == "hello" else self.answer(request)
            if reply is not None and "id" in request:
                self._sock.send_multipart([identity, m.encode({"ok": True, "id": request["id"], **reply})])

    def given(self, op: str, field: str) -> list[int]:
        """The ids the engine's `op` notifications named in `field` (aborted slots, released reads)."""
        return sorted(i for r in self.received if r["op"] == op for i in r[field])

    def count(self, op: str) -> int:
        return sum(r["op"] == op for r in self.received)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._zmq.term()
        self.arena.close()


@pytest.fixture
def serve(tmp_path):
    """`serve(answer, **hello)`: a fake server and a client attached to it (both closed at the end)."""
    made: list[tuple[FakeServer, CacheServerClient]] = []

    def start(answer: Answer = lambda request: {}, **hello: Any) -> tuple[FakeServer, CacheServerClient]:
        server = FakeServer(f"ipc://{tmp_path}/fake.sock", answer, **hello)
        client = CacheServerClient(server.url, METADATA, timeout=2)
        made.append((server, client))
        return server, client

    yield start
    for server, client in made:
        client.close()
        server.close()


def answering(op: str, reply: dict[str, Any]) -> Answer:
    return lambda request: reply if request["op"] == op else {}


def told(server: FakeServer, client: CacheServerClient, op: str, field: str) -> list[int]:
    """What the engine has given back so far (told with its next request)."""
    client.call("heartbeat")
    return server.given(op, field)


@pytest.mark.parametrize("slots, made, aborted", [
    ([[1, 0], [2, ARENA]], [1], [2]),  # outside the arena
    ([[1, 0], [2, ARENA - CHUNK + 1]], [1], [2]),  # its end is
    ([[1, 0], [2, "0"]], [1], [2]),
    ([[1, 0], [2, 0.5]], [1], [2]),
    ([[1, 0], 7], [1], []),
    ([[1, 0], [2, CHUNK], [3, 2 * CHUNK]], [1, 2], [3]),  # more slots than shapes
], ids=["outside", "overlapping-the-end", "offset-a-string", "offset-a-float", "not-a-pair", "one-too-many"])
def test_a_reserve_reply_naming_an_unusable_slot_gives_the_slots_before_it_and_aborts_the_rest(
        serve, slots, made, aborted):
    server, client = serve(answering("reserve", {"slots": slots}))
    got = client.allocate_many([SHAPE, SHAPE], torch.bfloat16)
    assert [s.slot for s in got] == made
    assert client.attached and client.counts.get("bad_replies") == 1
    assert told(server, client, "abort", "slots") == aborted
    release_all(got)
    assert told(server, client, "abort", "slots") == sorted([*made, *aborted])
    assert client.attachment.live == 0


@pytest.mark.parametrize("reply", [{}, {"slots": 3}, {"slots": None}], ids=["none", "an-int", "null"])
def test_a_reserve_reply_without_a_list_of_slots_is_a_miss(serve, reply):
    _, client = serve(answering("reserve", reply))
    assert client.allocate_many([SHAPE], torch.bfloat16) == []
    assert client.attached and client.counts.get("bad_replies") == 1


GOOD = [1, 0, list(SHAPE), "bfloat16"]
LAST = [3, 2 * CHUNK, list(SHAPE), "bfloat16"]


@pytest.mark.parametrize("bad, released", [
    ([2, CHUNK], [2]),
    (5, []),
    ([2, CHUNK, [-1, 512], "bfloat16"], [2]),  # a negative size would pass the bounds check
    ([2, CHUNK, [1 << 32, 1 << 32], "uint8"], [2]),  # torch's numel() wraps to 0
    ([2, ARENA, list(SHAPE), "bfloat16"], [2]),
    ([2, 0.5, list(SHAPE), "bfloat16"], [2]),
    ([2, CHUNK, list(SHAPE), "int33"], [2]),
    ([2, CHUNK, list(SHAPE), ["bfloat16"]], [2]),
    (["x", CHUNK, list(SHAPE), "bfloat16"], []),  # an id a release cannot name
    ([None, CHUNK, list(SHAPE), "bfloat16"], []),
], ids=["too-short", "not-a-list", "negative-dim", "numel-wraps", "outside", "offset-a-float",
        "unknown-dtype", "unhashable-dtype", "read-a-string", "read-null"])
def test_a_get_reply_with_an_unusable_chunk_ends_the_prefix_there_and_releases_the_rest(
        serve, bad, released):
    server, client = serve(answering("get", {"objs": [GOOD, bad, LAST]}))
    got = client.get([KEY, KEY, KEY])
    assert [g.read for g in got] == [1] and got[0].tensor.shape == SHAPE
    assert client.attached and client.counts.get("bad_replies") == 1
    assert told(server, client, "release", "reads") == sorted([*released, 3])
    release_all(got)
    assert told(server, client, "release", "reads") == sorted([1, *released, 3])
    assert client.attachment.live == 0


@pytest.mark.parametrize("reply", [{}, {"objs": {"a": 1}}], ids=["none", "an-object"])
def test_a_get_reply_without_a_list_of_chunks_is_a_miss(serve, reply):
    _, client = serve(answering("get", reply))
    assert client.get([KEY]) == []
    assert client.attached and client.counts.get("bad_replies") == 1


def test_heartbeats_the_server_refuses_are_counted_and_go_on(serve):
    server, client = serve(answering("heartbeat", {"ok": False, "code": "bad", "error": "no"}),
                           heartbeat=0.05)
    deadline = time.monotonic() + 10
    while server.count("heartbeat") < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.count("heartbeat") >= 4, "the heartbeat thread stopped at the first refusal"
    assert client.attached and client.counts.get("refused") >= 3


@pytest.mark.parametrize("heartbeat", [0, -1, float("inf"), 1e300], ids=["zero", "negative", "inf", "huge"])
def test_a_server_asking_for_an_unusable_heartbeat_interval_is_not_attached_to(serve, heartbeat):
    server, client = serve(heartbeat=heartbeat)
    time.sleep(0.5)
    assert not client.attached
    assert server.count("heartbeat") == 0 and server.count("hello") <= 2, "the client hammers the server"
    assert client._beats.is_alive()
