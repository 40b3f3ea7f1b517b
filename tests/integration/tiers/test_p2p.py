"""Peer-to-peer sharing with a real Valkey as the lookup service: the registry, engines in two
processes, dead and lying peers, and the peer server under malformed input."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis
import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import MemoryFormat, MixedMemoryAllocator
from lmcache.p2p.lookup_service import LookupService
from lmcache.p2p.peer_server import PeerServer
from lmcache.server import protocol
from lmcache.server.client import LMCacheClient, LMServerError
from lmcache.server.protocol import Op, Status
from lmcache.server.server import FrameServer, Reply, ServerThread
from lmcache.storage_backend.serde import create_serde, keyed_blob
from tests.helpers.servers import REPO
from tests.integration.tiers.peer_worker import CHUNK, paged_kv, peer_engine, tokens_for

pytestmark = pytest.mark.integration
WORKER = str(Path(__file__).with_name("peer_worker.py"))


def keys(n: int, tag: str = "k") -> list[CacheEngineKey]:
    return [CacheEngineKey("kv_blob", "m", 1, 0, f"{tag}{i:030x}", "bfloat16") for i in range(n)]


@pytest.fixture(params=["standalone", "cluster"])
def lookup_url(request, tmp_path):
    if request.param == "standalone":
        v = request.getfixturevalue("valkey")
        yield f"redis://127.0.0.1:{v.port}"
    else:
        nodes = request.getfixturevalue("cluster")
        yield "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)


def test_lookup_service_registers_withdraws_and_forgets_dead_instances(lookup_url):
    a = LookupService(lookup_url, "10.0.0.1:1", ttl=0.6, timeout=2)
    b = LookupService(lookup_url, "10.0.0.2:2", ttl=0.6, timeout=2)
    ks = keys(4)
    a.add(ks[:3])
    b.add(ks[2:3])
    assert a.flush() and b.flush()
    assert b.holders(ks) == [["10.0.0.1:1"], ["10.0.0.1:1"], ["10.0.0.1:1"], []]
    assert a.holders(ks) == [[], [], ["10.0.0.2:2"], []]  # never itself
    a.remove(ks[:1])
    assert a.flush()
    assert b.holders(ks)[:2] == [[], ["10.0.0.1:1"]]
    with a._cond:  # a dies: its heartbeat stops, nothing is withdrawn
        a._closed = True
        a._cond.notify_all()
    deadline = time.monotonic() + 5
    while b.holders(ks) != [[], [], [], []]:
        assert time.monotonic() < deadline, "a dead instance's registrations did not expire"
        time.sleep(0.1)
    b.close()


def test_registrations_the_store_lost_are_published_again_at_the_next_heartbeat(valkey):
    """The store restarted without its data (here: FLUSHALL): the instance's next heartbeat finds
    its entry gone and registers every key it still holds, and only those."""
    url = f"redis://127.0.0.1:{valkey.port}"
    a = LookupService(url, "10.0.0.1:1", ttl=0.6, timeout=2)
    b = LookupService(url, "10.0.0.2:2", ttl=0.6, timeout=2)
    ks = keys(4)
    try:
        a.add(ks)
        a.remove(ks[:1])
        assert a.flush()
        held = [[], ["10.0.0.1:1"], ["10.0.0.1:1"], ["10.0.0.1:1"]]
        assert b.holders(ks) == held
        store = redis.Redis(port=valkey.port)
        store.flushall()
        store.close()
        assert b.holders(ks) == [[], [], [], []]
        deadline = time.monotonic() + 5
        while b.holders(ks) != held:
            assert time.monotonic() < deadline, "the lost registrations were not published again"
            time.sleep(0.05)
    finally:
        a.close()
        b.close()


def test_the_lookup_service_refuses_a_non_redis_store():
    with pytest.raises(ValueError, match="Valkey/Redis"):
        LookupService("lm://127.0.0.1:1", "x:1", ttl=1, timeout=1)


def start_peer(lookup_url: str, ttl: float, *specs: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, WORKER, lookup_url, str(ttl), *specs], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"peer worker did not start: {line!r}")
    return proc, line.split()[1]


def connections_to(address: str) -> list:
    """This process's TCP connections to `address` (host:port), closing ones included."""
    port = int(address.rpartition(":")[2])
    return [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port]


def retrieve(engine, seed: int, n: int) -> int:
    kv = paged_kv(seed)
    slots = kv.slots_for(n)
    out = kv.empty_like()
    got = int(engine.retrieve(tokens_for(seed, n), kvcaches=out.layers, slot_mapping=slots).sum())
    assert torch.equal(out.tokens_kv(slots[:got]), kv.tokens_kv(slots[:got])), "retrieved KV differs"
    return got


def test_an_engine_reads_a_peer_process_chunks_and_survives_its_death(valkey):
    url = f"redis://127.0.0.1:{valkey.port}"
    proc, address = start_peer(url, 1.0, "1:40", "2:24")
    b = peer_engine(url, 1.0)
    try:
        assert b.lookup(tokens_for(1, 40)) == 40 and b.lookup(tokens_for(2, 24)) == 24
        assert retrieve(b, 1, 40) == 40  # bit-identical (checked in `retrieve`)
        assert b.storage_manager.contains_prefix(
            [k for _, _, k in b.token_database.process_tokens(tokens_for(1, 40))], "Hot").hits == 5
        assert connections_to(address)  # kept for the next pull
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        assert retrieve(b, 2, 24) == 0  # only the dead peer had these: a miss, no error
        assert time.monotonic() - t0 < 2.0 + 1.0  # within remote_timeout
        assert not connections_to(address)  # a failed peer's connections are closed, none left
        deadline = time.monotonic() + 1.0 + 2.0  # the registry forgets it within p2p_ttl
        while b.lookup(tokens_for(2, 24)) != 0:
            assert time.monotonic() < deadline, "lookups still count a dead peer's chunks"
            time.sleep(0.05)
        assert b.lookup(tokens_for(1, 40)) == 40 and retrieve(b, 1, 40) == 40  # pulled ones stay hits
    finally:
        proc.kill()
        b.close()


def test_the_connections_to_a_peer_that_died_are_closed_once_the_registry_forgets_it(valkey):
    url = f"redis://127.0.0.1:{valkey.port}"
    proc, address = start_peer(url, 1.0, "3:40")
    b = peer_engine(url, 1.0)
    try:
        assert retrieve(b, 3, 40) == 40 and connections_to(address)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 1.0 + 3.0  # p2p_ttl, and the instance list's refresh
        while connections_to(address):  # lookups of a prompt nobody holds ask the registry, and
            assert b.lookup(tokens_for(4, 40)) == 0  # never pull from the dead peer again
            assert time.monotonic() < deadline, connections_to(address)
            time.sleep(0.1)
    finally:
        proc.kill()
        b.close()


class LyingPeer(FrameServer):
    """Answers every GET with a valid keyed blob of another chunk, or with corrupt bytes."""

    def __init__(self, blob_for, corrupt: bool) -> None:
        super().__init__()
        self.blob_for, self.corrupt = blob_for, corrupt

    def dispatch(self, op, key, value):
        parts = self.blob_for(b"kv_blob@m@1@0@" + b"f" * 32 + b"@bfloat16" if not self.corrupt else key)
        data = bytearray(b"".join(bytes(p) for p in parts))
        if self.corrupt:
            data[-3] ^= 0xFF
        return Reply(Status.OK, [bytes(data)])


@pytest.mark.parametrize("corrupt", [False, True], ids=["wrong-key", "corrupt-bytes"])
def test_a_lying_peer_is_a_miss_logged_once(valkey, caplog, corrupt):
    url = f"redis://127.0.0.1:{valkey.port}"
    b = peer_engine(url, 5.0)
    meta = b.metadata
    serializer, _ = create_serde("naive", b.config, meta)
    chunk = torch.randn(2, 2, CHUNK, 8).to(torch.bfloat16)
    liar = ServerThread(LyingPeer(lambda k: keyed_blob.keyed_parts(k, serializer.to_parts(chunk)), corrupt),
                        "127.0.0.1", 0)
    registry = LookupService(url, f"127.0.0.1:{liar.port}", ttl=5, timeout=2)
    tokens = tokens_for(7, 24)
    registry.add([k for _, _, k in b.token_database.process_tokens(tokens)])
    assert registry.flush()
    try:
        assert b.lookup(tokens) == 24  # the registry says the liar has them
        for _ in range(3):
            assert retrieve(b, 7, 24) == 0
        peer = b.storage_manager.backends["PeerBackend"]
        assert peer.num_rejected == 1  # then the liar is left alone for its backoff delay
        logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert sum("peer 127.0.0.1" in m for m in logged) == 1
        assert b.lookup(tokens) == 0  # while backing off, its chunks are not counted
    finally:
        registry.close()
        liar.close()
        b.close()


# ---- the peer server under malformed input ------------------------------------------------------------


@pytest.fixture
def peer_server():
    meta = LMCacheEngineMetadata("m", 1, 0, "vllm", torch.bfloat16, (2, 2, CHUNK, 2, 4))
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)
    serializer, _ = create_serde("naive", config, meta)
    alloc = MixedMemoryAllocator(1 << 20)
    (k,) = keys(1)
    obj = alloc.allocate(torch.Size([2, 2, CHUNK, 8]), torch.bfloat16, MemoryFormat.KV_BLOB)
    obj.tensor.copy_(torch.randn(2, 2, CHUNK, 8))

    def read_local(key):
        if key != k:
            return None
        obj.ref_count_up()
        return obj

    server = PeerServer(read_local, lambda key: key == k, serializer, frame_timeout=0.3)
    thread = ServerThread(server, "127.0.0.1", 0)
    yield thread, k, obj
    thread.close()
    assert obj.get_ref_count() == 1  # every reference taken to serve it was dropped
    obj.ref_count_down()


def test_the_peer_server_answers_gets_and_refuses_writes(peer_server):
    thread, k, obj = peer_server
    c = LMCacheClient("127.0.0.1", thread.port)
    value = c.get(k.to_string())
    assert value is not None and bytes(value[-obj.get_size():]) == bytes(obj.byte_array)
    assert bytes(value[8: 8 + len(k.to_string())]) == k.to_string().encode()  # a keyed blob
    assert c.get(keys(1, "x")[0].to_string()) is None and c.get("not-a-key") is None
    assert c.exists(k.to_string()) and not c.exists("nope")
    for call in (lambda: c.put(k.to_string(), b""), lambda: c.delete(k.to_string()), lambda: c.list_keys()):
        with pytest.raises(LMServerError, match="read-only"):
            call()
    assert c.get(k.to_string()) is not None  # the connection is still good
    assert c.health()["ops"]["GET"] == 4
    c.close()


def raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        chunks = []
        while got := s.recv(1 << 16):
            chunks.append(got)
        return b"".join(chunks)


@pytest.mark.parametrize("frame", [
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, Op.GET, 1 << 30, 0), id="huge-key"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, Op.PUT, 3, 1 << 62) + b"abc",
                 id="huge-value"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, Op.PUT, 1, 10) + b"k",
                 id="any-value"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, 42, 0, 0), id="unknown-op"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, 9, Op.GET, 1, 0) + b"k", id="bad-version"),
])
def test_a_malformed_frame_closes_only_its_connection(peer_server, frame):
    thread, k, _ = peer_server
    c = LMCacheClient("127.0.0.1", thread.port)
    assert c.exists(k.to_string())  # a connection open while the bad frame arrives
    answer = raw_exchange(thread.port, frame)
    status, _ = protocol.unpack_response(answer[: protocol.HEADER_SIZE])
    assert status == Status.ERROR
    assert c.get(k.to_string()) is not None
    c.close()


def test_half_open_and_stalled_connections_are_dropped(peer_server):
    thread, k, _ = peer_server
    idle = [socket.create_connection(("127.0.0.1", thread.port)) for _ in range(50)]
    for s in idle[:25]:
        s.sendall(protocol.pack_request(Op.GET, b"x" * 100)[:20])  # a header, then a stall
    t0 = time.monotonic()
    for s in idle[:25]:
        s.settimeout(5)
        assert s.recv(16) == b""  # dropped after the frame timeout
    assert time.monotonic() - t0 < 5
    c = LMCacheClient("127.0.0.1", thread.port)
    assert c.get(k.to_string()) is not None  # still serving, with 25 idle connections open
    c.close()
    for s in idle:
        s.close()


def test_a_chunk_that_fails_to_read_gets_an_error_reply_and_the_peer_server_keeps_serving(peer_server):
    thread, k, _ = peer_server
    failing = keys(1, "bad")[0]
    server = thread.server
    read_local = server._read_local

    def read_or_fail(key):
        if key == failing:
            raise RuntimeError("the tier could not read the chunk")  # a local tier's bug
        return read_local(key)

    server._read_local = read_or_fail
    c = LMCacheClient("127.0.0.1", thread.port, timeout=5)
    try:
        with pytest.raises(LMServerError, match="could not read"):
            c.get(failing.to_string())
        assert c.get(k.to_string()) is not None
        assert c.health()["ops"]["GET"] == 2 and server.num_failed_requests == 1
    finally:
        c.close()


def test_registrations_kept_for_a_stalled_store_stay_within_the_queue_bound(monkeypatch):
    monkeypatch.setattr("lmcache.p2p.lookup_service.MAX_QUEUED", 10)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    svc = LookupService(f"redis://127.0.0.1:{silent.getsockname()[1]}", "x:1", ttl=0.9, timeout=0.3)

    def wait_until(condition) -> None:
        deadline = time.monotonic() + 10
        while True:
            with svc._cond:
                if condition():
                    return
            assert time.monotonic() < deadline
            time.sleep(0.005)

    try:
        wait_until(lambda: svc.fault_counts()["failures"] == 1 and not svc._sending)  # the first beat
        svc.remove(keys(10, "a"))
        wait_until(lambda: svc._sending and not svc._removes)  # on their way to the store
        svc.remove(keys(10, "b"))  # queued meanwhile
        wait_until(lambda: svc.fault_counts()["failures"] == 2 and not svc._sending)  # kept for later
        with svc._cond:
            assert len(svc._removes) <= 10 and svc.num_dropped == 10
    finally:
        svc.close()
        silent.close()
