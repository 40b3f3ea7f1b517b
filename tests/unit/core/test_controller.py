"""The engine's HTTP controller over real HTTP on loopback, and the `lmcache` commands that wrap it."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
import torch

from lmcache import cli
from lmcache.json_http import JsonHTTPService, RawReply
from tests.helpers import WRITE_WAIT
from tests.helpers.paged_kv import PagedKV, build_engine

CHUNK = 8
CHUNK_BYTES = 2 * 2 * CHUNK * 8 * 2


@pytest.fixture
def served(tmp_path):
    engine = build_engine(CHUNK, cpu_bytes=6 * CHUNK_BYTES, controller_url="127.0.0.1:0",
                          local_disk=str(tmp_path), max_local_disk_size=0.01)
    engine.controller.tokenize = lambda text: [ord(c) for c in text]
    yield engine, f"http://127.0.0.1:{engine.controller.port}"
    engine.close()


def call(base: str, path: str, body=None, method: str | None = None, raw: bytes | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    method = method or ("GET" if data is None else "POST")
    request = urllib.request.Request(base + path, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def store(engine, tokens, kv=None):
    kv = kv or PagedKV(num_blocks=128)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(tokens.shape[0]))
    assert engine.storage_manager.backends["LocalDiskBackend"].puts.flush(WRITE_WAIT)
    return kv


def test_health_and_stats(served):
    engine, base = served
    store(engine, torch.arange(24))
    assert call(base, "/health") == (200, {"status": "ok", "tiers": {"Hot": True, "LocalDiskBackend": True}})
    status, stats = call(base, "/stats")
    assert status == 200 and stats["engine"]["stored_tokens"] == 24
    tiers = stats["tiers"]
    assert tiers["Hot"]["gauges"]["chunks"] == 3 and tiers["LocalDiskBackend"]["gauges"]["files"] == 3
    assert tiers["LocalDiskBackend"]["counters"]["bytes_written"] == 3 * CHUNK_BYTES


def test_lookup_by_tokens_and_by_text_per_tier(served):
    engine, base = served
    text = "a prompt of thirty-two chars...."
    ids = torch.tensor([ord(c) for c in text])
    store(engine, ids[:24])
    first = next(iter(engine.token_database.process_tokens(ids[:24])))[2]
    engine.storage_manager.hot.remove(first)  # chunk 0: disk only
    expected = {"tokens": 32, "cached_tokens": 24, "tiers": {"Hot": 0, "LocalDiskBackend": 24}, "peers": {}}
    assert call(base, "/lookup", {"text": text}) == (200, expected)
    assert call(base, "/lookup", {"tokens": ids.tolist()}) == (200, expected)
    assert call(base, "/lookup", {"tokens": ids.tolist(), "extra_key": "salt"})[1]["cached_tokens"] == 0
    engine.controller.tokenize = None
    status, answer = call(base, "/lookup", {"text": text})
    assert status == 400 and "no tokenizer" in answer["error"]


def test_a_cleared_prefix_misses_afterwards(served):
    engine, base = served
    tokens = torch.arange(100, 124)
    store(engine, tokens)
    assert call(base, "/clear", {"tier": "hot"}) == (200, {"cleared": {"Hot": 3}})
    assert engine.lookup(tokens, "Hot") == 0 and engine.lookup(tokens) == 24  # still on disk
    assert call(base, "/clear", {"tier": "all"}) == (200, {"cleared": {"Hot": 0, "LocalDiskBackend": 3}})
    assert engine.lookup(tokens) == 0
    out = PagedKV(num_blocks=128)
    assert int(engine.retrieve(tokens, kvcaches=out.layers, slot_mapping=out.slots_for(24)).sum()) == 0


def test_a_pinned_prefix_survives_hot_tier_pressure(served):
    engine, base = served
    kv = PagedKV(num_blocks=128)
    pinned = torch.arange(200, 216)
    store(engine, pinned, kv)
    status, answer = call(base, "/pin", {"tokens": pinned.tolist()})
    assert status == 200 and answer["pinned_tokens"] == 16
    for i in range(4):  # the arena holds 6 chunks: storing 12 more must evict
        store(engine, torch.arange(1000 + 24 * i, 1024 + 24 * i), kv)
    assert engine.storage_manager.hot.num_evicted > 0 and engine.lookup(pinned, "Hot") == 16
    assert call(base, "/unpin", {"lease": answer["lease"]}) == (200, {"released": answer["lease"]})
    for i in range(4):
        store(engine, torch.arange(2000 + 24 * i, 2024 + 24 * i), kv)
    assert engine.lookup(pinned, "Hot") == 0


@pytest.mark.parametrize("path, body, raw, status, message", [
    ("/lookup", None, b"{not json", 400, "not valid JSON"),
    ("/lookup", None, b"[1, 2]", 400, "JSON object"),
    ("/lookup", {"tokens": [1], "colour": "red"}, None, 400, "unknown field(s) ['colour']"),
    ("/lookup", {"tokens": [1], "text": "a"}, None, 400, "exactly one of"),
    ("/lookup", {"tokens": ["a"]}, None, 400, "integer token ids"),
    ("/lookup", {"tokens": [-1]}, None, 400, "integer token ids"),
    ("/lookup", {"tokens": []}, None, 400, "empty"),
    ("/clear", {}, None, 400, "missing field(s) ['tier']"),
    ("/clear", {"tier": "remote"}, None, 400, "'tier' must be one of"),
    ("/pin", {"tokens": [1], "ttl": -5}, None, 400, "'ttl'"),
    ("/unpin", {"lease": 7}, None, 400, "'lease'"),
    ("/nope", {}, None, 404, "no endpoint /nope"),
])
def test_bad_requests_get_a_status_and_a_message(served, path, body, raw, status, message):
    _, base = served
    got, answer = call(base, path, body, raw=raw)
    assert got == status and message in answer["error"]


def test_wrong_methods_and_huge_bodies_are_refused(served):
    _, base = served
    assert call(base, "/health", {}, method="POST")[0] == 405
    assert call(base, "/lookup", method="GET")[0] == 405
    request = urllib.request.Request(base + "/lookup", data=b"{}", method="POST",
                                     headers={"Content-Length": str(1 << 30)})
    with pytest.raises((urllib.error.HTTPError, OSError)) as err:
        urllib.request.urlopen(request, timeout=10)
    assert getattr(err.value, "code", 413) == 413


def test_the_command_line_wraps_the_controller(served, capsys):
    engine, base = served
    store(engine, torch.arange(300, 316))
    url = base.removeprefix("http://")
    assert cli.main(["health", "--url", url]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    assert cli.main(["lookup", "--url", url, "--tokens", ",".join(map(str, range(300, 316)))]) == 0
    assert json.loads(capsys.readouterr().out)["cached_tokens"] == 16
    assert cli.main(["clear", "--url", url, "--tier", "all"]) == 0
    assert json.loads(capsys.readouterr().out)["cleared"] == {"Hot": 2, "LocalDiskBackend": 2}
    assert cli.main(["pin", "--url", url, "--text", "abc", "--ttl", "5"]) == 0
    lease = json.loads(capsys.readouterr().out)["lease"]
    assert cli.main(["unpin", "--url", url, "--lease", lease]) == 0
    capsys.readouterr()
    assert cli.main(["clear", "--url", url, "--tier", "hot", "--timeout", "5"]) == 0
    capsys.readouterr()
    assert cli.main(["health", "--url", "127.0.0.1:1"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def raw_exchange(port: int, request: bytes) -> bytes:
    """`request` sent as is on a fresh connection; what the server answered before closing it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("length", [b"abc", b"-1", b"-5", b"1e3"])
def test_a_bad_content_length_gets_400_and_the_server_keeps_serving(served, length):
    engine, base = served
    answer = raw_exchange(engine.controller.port, b"POST /lookup HTTP/1.1\r\nHost: x\r\nContent-Length: "
                          + length + b"\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.0 400")
    assert b"Content-Length must be a byte count, got " + length in answer
    assert call(base, "/health")[0] == 200


def test_a_content_length_of_thousands_of_digits_gets_413(served):
    engine, base = served
    answer = raw_exchange(engine.controller.port, b"POST /lookup HTTP/1.1\r\nHost: x\r\nContent-Length: "
                          + b"9" * 5000 + b"\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.0 413") and b"body over" in answer
    assert call(base, "/health")[0] == 200


@pytest.mark.parametrize("value, message", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"1" * 5000, "not valid JSON: Exceeds the limit (4300 digits)"),
])
def test_json_python_cannot_parse_gets_400_not_a_dropped_connection(served, value, message):
    _, base = served
    status, answer = call(base, "/lookup", raw=b'{"tokens": ' + value + b"}")
    assert status == 400 and message in answer["error"]
    assert call(base, "/health")[0] == 200


@pytest.mark.parametrize("ttl", [b"1" + b"0" * 400, b"1e999", b"Infinity"])
def test_a_ttl_too_large_for_a_float_gets_400(served, ttl):
    _, base = served
    status, answer = call(base, "/pin", raw=b'{"tokens": [1, 2, 3], "ttl": ' + ttl + b"}")
    assert status == 400 and "'ttl' must be a finite number of seconds > 0" in answer["error"]


@pytest.mark.parametrize("method", ["PATCH", "OPTIONS"])
def test_other_methods_get_405_in_json(served, method):
    _, base = served
    status, answer = call(base, "/lookup", method=method)
    assert status == 405 and answer == {"error": f"{method} is not allowed on /lookup"}


@pytest.mark.parametrize("argv, message", [
    (["lookup", "--tokens", "1,a"], "--tokens: '1,a' is not a list of comma-separated token ids"),
    (["health", "--timeout", "-1"], "--timeout: must be a number of seconds > 0, got '-1'"),
])
def test_the_command_line_refuses_bad_arguments_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--url", "127.0.0.1:1"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_command_line_reports_a_bad_url_or_an_answer_that_is_not_json(capsys):
    assert cli.main(["health", "--url", "127.0.0.1:port"]) == 1
    assert "bad --url http://127.0.0.1:port" in capsys.readouterr().err
    not_json = RawReply("text/plain", b"hello")
    service = JsonHTTPService({("GET", "/health"): lambda body: not_json}, "127.0.0.1", 0, "test")
    try:
        assert cli.main(["health", "--url", f"127.0.0.1:{service.port}"]) == 1
        assert "did not answer JSON" in capsys.readouterr().err
    finally:
        service.close()


def test_an_operators_lookup_and_pin_are_not_counted_as_serving_lookups(served):
    """The engine's lookup counters (and vLLM's hit rate from them) are the serving engine's; a
    /lookup asked the engine once per tier and once more, and each call counted."""
    engine, base = served
    tokens = torch.arange(400, 424)
    store(engine, tokens)
    before = engine.stats.snapshot()
    assert call(base, "/lookup", {"tokens": tokens.tolist()})[1]["cached_tokens"] == 24
    assert call(base, "/pin", {"tokens": tokens.tolist()})[1]["pinned_tokens"] == 24
    after = engine.stats.snapshot()
    assert after.get("lookup_requests", 0) == before.get("lookup_requests", 0)  # was 4 more
    assert after.get("lookup_hit_tokens", 0) == before.get("lookup_hit_tokens", 0)  # was 96 more
    engine.lookup(tokens)  # a serving lookup counts
    assert engine.stats.snapshot()["lookup_requests"] == before.get("lookup_requests", 0) + 1


def _post_head(port: int, length: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length + body)
    return sock


def _status_line(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_a_body_shorter_than_its_length_is_refused_and_a_stalled_one_does_not_hold_a_thread():
    """A client that closes its side before the body's declared length gets 400, not a route called
    with a truncated body; one that stalls mid-body is answered 408 after the service's timeout
    and its connection closed (it held a thread for as long as it kept the socket open)."""
    seen = []
    service = JsonHTTPService({("POST", "/echo"): lambda body: seen.append(body) or {}}, "127.0.0.1", 0,
                              "test", timeout=0.5)
    try:
        short = _post_head(service.port, 100, b'{"a": 1}')
        short.shutdown(socket.SHUT_WR)
        assert _status_line(short) == b"HTTP/1.0 400 Bad Request"
        stalled = _post_head(service.port, 100, b'{"a": 1')
        assert _status_line(stalled) == b"HTTP/1.0 408 Request Timeout"
        assert seen == []
        assert call(f"http://127.0.0.1:{service.port}", "/echo", {"a": 2}) == (200, {})
        assert seen == [{"a": 2}]
    finally:
        service.close()
