import uuid

import numpy as np
import pytest
import zmq

from lmcache.integration.vllm.lookup_channel import LookupClient, LookupServer, socket_path


def address():
    return socket_path(f"unit-{uuid.uuid4().hex[:8]}", 0)


def test_lookup_round_trip_and_minimum_over_ranks():
    seen = []

    def handler(hit):
        def answer(header, tokens):
            seen.append((header["lease"], header["extra_key"], tokens.tolist()))
            return {"hit": hit}
        return answer

    a, b = address(), address()
    servers = [LookupServer(a, handler(512)), LookupServer(b, handler(256))]
    client = LookupClient([a, b], timeout=2)
    try:
        assert client.lookup("req-1", [1, 2, 3], "salt=x") == 256
        assert seen[0] == ("req-1", "salt=x", [1, 2, 3])
    finally:
        client.close()
        for s in servers:
            s.close()


def test_unreachable_or_slow_worker_is_a_miss_and_the_client_recovers():
    addr = address()
    client = LookupClient([addr], timeout=0.2)
    assert client.lookup("r", [1, 2], None) == 0  # nobody listening yet
    server = LookupServer(addr, lambda header, tokens: {"hit": len(tokens)})
    try:
        assert client.lookup("r", [1, 2, 3], None) == 3  # the socket was replaced after the timeout
    finally:
        client.close()
        server.close()


def test_handler_errors_and_malformed_frames_do_not_kill_the_server():
    def answer(header, tokens):
        if header.get("cmd") == "boom":
            raise RuntimeError("handler failed")
        return {"hit": 7}

    addr = address()
    server = LookupServer(addr, answer)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.REQ)
    raw.connect(addr)
    try:
        for frames in ([b"not json"], [b'{"cmd": "lookup"}', b"\x01\x02\x03"], [b"[1, 2]"],
                       [b'{"cmd": "boom"}']):
            raw.send_multipart(frames)
            assert raw.poll(2000)
            assert "error" in raw.recv_json()
        client = LookupClient([addr], timeout=2)
        assert client.lookup("r", [5], None) == 7
        client.close()
    finally:
        raw.close(0)
        ctx.term()
        server.close()


def test_token_frame_is_int64():
    got = {}

    def answer(header, tokens):
        got["dtype"], got["tokens"] = tokens.dtype, tokens.tolist()
        return {"hit": 0}

    addr = address()
    server = LookupServer(addr, answer)
    client = LookupClient([addr], timeout=2)
    try:
        client.lookup("r", [2**40, 3], None)
        assert got["dtype"] == np.dtype("<i8") and got["tokens"] == [2**40, 3]
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("reply", [{"error": "engine not ready"}])
def test_error_replies_count_as_misses(reply):
    addr = address()
    server = LookupServer(addr, lambda header, tokens: reply)
    client = LookupClient([addr], timeout=2)
    try:
        assert client.lookup("r", [1], None) == 0
    finally:
        client.close()
        server.close()


def test_clear_reaches_every_rank_and_reports_a_missing_one():
    import torch

    from tests.helpers.paged_kv import PagedKV, build_engine
    from tests.unit.vllm.test_worker_faults import worker_over

    engine = build_engine(8)
    kv = PagedKV()
    tokens = torch.arange(16)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    worker = worker_over(engine, kv)
    a, b = address(), address()
    server = LookupServer(a, worker._answer)
    client = LookupClient([a], timeout=2)
    try:
        assert engine.lookup(tokens, "Hot") == 16
        assert client.clear("hot")
        assert engine.lookup(tokens, "Hot") == 0
    finally:
        client.close()
    partial = LookupClient([a, b], timeout=0.2)  # rank 1 never answers
    try:
        assert not partial.clear("hot")
    finally:
        partial.close()
        server.close()
        engine.close()
