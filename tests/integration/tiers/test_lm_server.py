import signal
import socket
import struct
import threading
import time

import pytest

from lmcache.server import protocol
from lmcache.server.client import LMCacheClient, ValueTooLargeError
from lmcache.server.protocol import Op
from lmcache.server.server import LMCacheServer, ServerThread
from tests.helpers.servers import free_port

pytestmark = pytest.mark.integration


def raw_frame(port: int, data: bytes, read: bool = True) -> bytes:
    """Send `data` on a fresh connection; return what the server answers before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        if not read:
            return b""
        chunks = []
        while True:
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            chunks.append(got)
        return b"".join(chunks)


def test_every_command_round_trips(lm_server):
    srv = lm_server()
    c = LMCacheClient("127.0.0.1", srv.port)
    c.put("a/1", b"x" * 1000)
    c.put("a/2", [b"he", memoryview(b"llo")])
    c.put("b/1", b"")
    assert c.get("a/1") == b"x" * 1000 and c.get("a/2") == b"hello" and c.get("b/1") == b""
    assert c.get("nope") is None
    assert c.exists("a/1") and not c.exists("nope")
    assert sorted(c.list_keys("a/")) == ["a/1", "a/2"]
    assert c.get_many(["a/2", "nope", "a/1"]) == [b"hello", None, b"x" * 1000]
    health = c.health()
    assert {k: health[k] for k in ("items", "bytes")} == {"items": 3, "bytes": 1005}
    assert health["ops"] == {"PUT": 3, "GET": 7, "EXISTS": 2, "LIST": 1, "HEALTH": 1}
    assert c.exists_many(["a/1", "nope", "b/1"]) == [True, False, True]
    assert c.delete("a/1") and not c.delete("a/1") and c.get("a/1") is None
    c.close()


@pytest.mark.parametrize("frame", [
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, Op.GET, 1 << 30, 0), id="huge-key"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, Op.PUT, 3, 1 << 62) + b"abc",
                 id="huge-value"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, 42, 0, 0), id="unknown-op"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, 9, Op.GET, 1, 0) + b"k", id="bad-version"),
    pytest.param(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, Op.GET, 1, 10) + b"k",
                 id="value-on-get"),
])
def test_a_malformed_frame_gets_an_error_and_closes_only_that_connection(lm_server, frame):
    srv = lm_server("--max-frame-mb", "1")
    c = LMCacheClient("127.0.0.1", srv.port)
    c.put("k", b"v")  # a connection that is open while the bad frame arrives
    answer = raw_frame(srv.port, frame)
    status, length = protocol.unpack_response(answer[: protocol.HEADER_SIZE])
    assert status == protocol.Status.ERROR and len(answer) == protocol.HEADER_SIZE + length
    assert c.get("k") == b"v"  # the pooled connection still works
    assert LMCacheClient("127.0.0.1", srv.port).health()["items"] == 1
    assert srv.proc.poll() is None


def test_truncated_and_stalled_frames_do_not_hurt_the_server(lm_server):
    srv = lm_server("--frame-timeout", "0.3")
    head = protocol.pack_request(Op.PUT, b"key", 1000)
    raw_frame(srv.port, head + b"only-part", read=False)  # sender hangs up mid-frame
    with socket.create_connection(("127.0.0.1", srv.port)) as stalled:
        stalled.sendall(head + b"x" * 10)  # and this one just stops sending
        t0 = time.monotonic()
        assert stalled.recv(10) == b""  # dropped after the frame timeout
        assert time.monotonic() - t0 < 5
    c = LMCacheClient("127.0.0.1", srv.port)
    assert not c.exists("key") and c.health()["items"] == 0


def test_an_idle_connection_stays_but_one_stalled_inside_a_header_is_dropped(lm_server):
    srv = lm_server("--frame-timeout", "0.3")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as idle, \
            socket.create_connection(("127.0.0.1", srv.port), timeout=5) as stalled:
        stalled.sendall(protocol.pack_request(Op.EXISTS, b"key")[:3])  # 3 of the header's bytes
        t0 = time.monotonic()
        assert stalled.recv(10) == b""  # dropped after the frame timeout
        assert time.monotonic() - t0 < 5
        idle.sendall(protocol.pack_request(Op.EXISTS, b"key"))  # idle for longer than that: served
        assert protocol.unpack_response(idle.recv(protocol.HEADER_SIZE))[0] == protocol.Status.NOT_FOUND


def test_auth_token_is_required_and_checked(lm_server):
    srv = lm_server("--auth-token", "s3cret")
    with pytest.raises(PermissionError):
        LMCacheClient("127.0.0.1", srv.port).get("k")
    with pytest.raises(PermissionError):
        LMCacheClient("127.0.0.1", srv.port, auth_token="wrong").get("k")
    good = LMCacheClient("127.0.0.1", srv.port, auth_token="s3cret")
    good.put("k", b"v")
    assert good.get("k") == b"v"


def test_auth_token_from_the_environment(lm_server):
    srv = lm_server(env={"LMCACHE_AUTH_TOKEN": "envtoken"})
    with pytest.raises(PermissionError):
        LMCacheClient("127.0.0.1", srv.port).get("k")
    assert LMCacheClient("127.0.0.1", srv.port, auth_token="envtoken").get("k") is None


def test_capacity_is_enforced_least_recently_used_first(lm_server):
    srv = lm_server("--max-size-gb", str(1000 / (1 << 30)))  # ~1000 bytes
    c = LMCacheClient("127.0.0.1", srv.port)
    for k in ("a", "b"):
        c.put(k, b"x" * 400)
    c.get("a")
    c.put("c", b"x" * 400)
    assert [c.exists(k) for k in "abc"] == [True, False, True]
    with pytest.raises(ValueTooLargeError, match="larger than the server's capacity"):
        c.put("big", b"x" * 2000)
    assert c.health()["bytes"] <= 1000


def test_sigterm_shuts_down_cleanly_with_connections_open(lm_server):
    srv = lm_server()
    c = LMCacheClient("127.0.0.1", srv.port)
    c.put("k", b"v")  # leaves an idle pooled connection open
    assert srv.stop(signal.SIGTERM) == 0
    with pytest.raises(ConnectionError):
        c.get("k")


def test_client_reconnects_at_the_next_call_after_a_server_restart(lm_server):
    """The client has no backoff of its own (the caller's failure domain has): every call whose
    server is down raises, and the first call after it is back reconnects."""
    port = free_port()
    srv = lm_server(port=port)
    c = LMCacheClient("127.0.0.1", port)
    c.put("k", b"v")
    srv.stop()
    for _ in range(2):
        with pytest.raises(ConnectionError):
            c.get("k")  # a stale pooled connection, then refused reconnects
    lm_server(port=port)
    deadline = time.monotonic() + 5
    while True:
        try:
            assert c.get("k") is None  # a fresh server: empty, but reachable again
            break
        except ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    c.put("k2", b"v2")
    assert c.get("k2") == b"v2"


def test_a_call_after_a_server_restart_succeeds_with_several_stale_pooled_connections():
    """Every pooled connection is stale after a restart: the one retry is made on a fresh
    connection, never on another stale one from the pool."""
    srv = ServerThread(LMCacheServer(1 << 20), "127.0.0.1", 0)
    port = srv.port
    c = LMCacheClient("127.0.0.1", port, timeout=5)
    c.put("k", b"v")
    both_reading = threading.Barrier(3, timeout=5)

    def read(_, stream, length):
        both_reading.wait()  # two connections borrowed at once: two pooled afterwards

    readers = [threading.Thread(target=c.get_many_into, args=(["k"], read)) for _ in range(2)]
    for t in readers:
        t.start()
    both_reading.wait()
    for t in readers:
        t.join(5)
    srv.close()
    srv = ServerThread(LMCacheServer(1 << 20), "127.0.0.1", port)
    try:
        c.put("k2", b"v2")
        assert c.get("k2") == b"v2"
    finally:
        c.close()
        srv.close()


@pytest.mark.parametrize("status", [protocol.Status.NOT_FOUND, protocol.Status.ERROR])
def test_a_refusal_claiming_a_huge_message_is_a_protocol_error_not_an_allocation(status):
    """A server answering a refusal must not make the client buffer more than a message."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, status, 0, 1 << 62))
            conn.recv(1024)  # until the client hangs up

    server = threading.Thread(target=answer, daemon=True)
    server.start()
    c = LMCacheClient("127.0.0.1", listener.getsockname()[1], timeout=5)
    try:
        with pytest.raises(protocol.ProtocolError, match="refusal"):
            c.get("k")
    finally:
        c.close()
        server.join(5)
        listener.close()


def test_a_server_thread_closed_mid_request_lets_the_request_release_what_it_holds(caplog):
    """A peer server's answer holds a reference on the memory it sends until it is handed to the
    transport (`Reply.release`). A `ServerThread` closed while a blocking dispatch ran closed its
    loop under the pending handler: the release never ran (the chunk stayed referenced) and asyncio
    logged "Task was destroyed but it is pending!"."""
    from lmcache.server.server import FrameServer, Reply

    released = threading.Event()
    dispatching = threading.Event()

    class Slow(FrameServer):
        blocking_dispatch = True

        def dispatch(self, op, key, value):
            dispatching.set()
            time.sleep(0.5)
            return Reply(protocol.Status.OK, [b"v"], release=released.set)

    srv = ServerThread(Slow(), "127.0.0.1", 0)
    client = LMCacheClient("127.0.0.1", srv.port, timeout=5)
    outcome: list[object] = []

    def get() -> None:
        try:
            outcome.append(client.get("k"))
        except ConnectionError as e:
            outcome.append(e)

    reader = threading.Thread(target=get)
    reader.start()
    assert dispatching.wait(5)
    with caplog.at_level("ERROR", logger="asyncio"):
        srv.close()
        reader.join(5)
    client.close()
    assert released.is_set()
    assert len(outcome) == 1 and "destroyed but it is pending" not in caplog.text
