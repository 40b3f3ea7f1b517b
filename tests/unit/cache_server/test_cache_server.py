"""The cache server with real processes: `lmcache cache-server` and engine processes attached to
it (`engine_worker.py`), over its real ipc socket and shared memory.

Sharing (one engine's store is the other's hit, one copy), faults (an engine SIGKILLed holding
slots and reads, one that cannot be watched and goes silent, the server SIGKILLed and restarted, a
restart between heartbeats, an engine closing while the server stalls), a full L1 (and two models
sharing it), malformed control messages, the operations endpoint (pins too), two servers sharing
chunks as peers, and no shared-memory segment left behind by any test.
"""

from __future__ import annotations

import base64
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.cache_server import messages as m
from lmcache.cache_server import shm
from lmcache.cache_server.server import CacheServer
from lmcache.config import LMCacheEngineMetadata
from tests.helpers.servers import REPO, STARTED, CacheServerProcess, first_line, free_port, native_stacks

WORKER = Path(__file__).with_name("engine_worker.py")
CHUNK_BYTES = 2 * 2 * 8 * 8 * 2  # [2, layers, chunk, hidden] bf16
DOC = list(range(1000, 1064))  # 8 chunks


def segments() -> set[str]:
    """The arenas in /dev/shm of the servers this test process runs or started (not of another
    test process's, which may run beside it)."""
    ours = {os.getpid(), *STARTED}
    return {p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}-*") if int(p.name.split("-")[2]) in ours}


@pytest.fixture(autouse=True)
def no_segment_left():
    before = segments()
    yield
    deadline = time.monotonic() + 10
    while segments() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert segments() - before == set(), "a shared-memory segment was left in /dev/shm"


@pytest.fixture
def url(tmp_path):
    return f"ipc://{tmp_path}/cache.sock"


@pytest.fixture
def server(url):
    s = CacheServerProcess(url).start()
    yield s
    s.stop()


# How long an engine worker waits for the server's answer: long where a test means the server to
# answer (a starved CI machine must not turn a slow answer into an outage), short where a test
# stops or stalls the server and means the engine to give up on it.
PATIENT, OUTAGE = 30.0, 2.0
# A heartbeat interval no test run reaches, for a test where a heartbeat must not come.
SLOW_HEARTBEAT = 600.0
# How long a worker may take to exit once told to close (its engine does not wait on the server:
# see the test of a close while the server stalls); one that takes longer shows its threads' stacks.
CLOSE_WAIT = 30.0
START_CAP = 600.0  # seconds an engine worker may take to start while it keeps using CPU


class Worker:
    def __init__(self, url: str, model: str = "test-model", timeout: float = PATIENT) -> None:
        """Starts the engine worker; `wait_ready` waits for it."""
        env = {**os.environ, "PYTHONPATH": str(REPO), "LMCACHE_LOG_LEVEL": "WARNING",
               "PYTHONFAULTHANDLER": "1"}  # a worker that hangs shows where (see `close`)
        self.proc = subprocess.Popen([sys.executable, str(WORKER), url, model, str(timeout)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)

    def wait_ready(self) -> None:
        """Waits while it starts (imports torch: minutes on a loaded machine)."""
        line, why = first_line(self.proc, START_CAP)
        assert line, f"the engine worker did not start: {why}; its stderr:\n{self.stop_for_log()}"
        assert json.loads(line) == {"ready": True}

    def stop_for_log(self) -> str:
        self.proc.kill()
        return self.proc.communicate(timeout=30)[1]

    def _line(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "the engine worker did not answer"
        return json.loads(self.proc.stdout.readline())

    def ask(self, op: str, timeout: float = 30, **fields) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def wait_attached(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while not self.ask("attached")["attached"]:
            assert time.monotonic() < deadline, "the engine did not attach again"
            time.sleep(0.1)

    def close(self) -> str:
        """Stop it; its log (stderr)."""
        if self.proc.poll() is None:
            self.ask_close()
        try:
            _, err = self.proc.communicate(timeout=CLOSE_WAIT)
        except subprocess.TimeoutExpired:
            stacks = native_stacks(self.proc.pid)
            self.proc.send_signal(signal.SIGABRT)  # the fault handler prints every thread's stack
            _, err = self.proc.communicate(timeout=30)
            pytest.fail(f"the engine worker did not exit within {CLOSE_WAIT:g} s of close:\n{err}\n"
                        f"its C stacks:\n{stacks}")
        return err

    def ask_close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)


class Workers:
    """A test's engine workers (`url` unless named `at`); those still running at its end are killed."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.made: list[Worker] = []

    def __call__(self, at: str | None = None, model: str = "test-model", timeout: float = PATIENT) -> Worker:
        (worker,) = self.start(1, at, model, timeout)
        return worker

    def start(self, n: int, at: str | None = None, model: str = "test-model",
              timeout: float = PATIENT) -> list[Worker]:
        """`n` workers started at once (their start-ups, mostly imports, overlap), once all are
        ready and attached to their server."""
        new = [Worker(at or self.url, model, timeout) for _ in range(n)]
        self.made += new
        for worker in new:
            worker.wait_ready()
        for worker in new:
            worker.wait_attached()
        return new


def close_then_stop(server: CacheServerProcess, *workers: Worker) -> list[str]:
    """Close `workers` in order (their logs), then stop `server`, whatever the closes did."""
    try:
        return [worker.close() for worker in workers]
    finally:
        server.stop()


@pytest.fixture
def workers(url):
    made = Workers(url)
    yield made
    for w in made.made:
        if w.proc.poll() is None:
            w.kill()


def wait_for(check, timeout: float, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("timed out")


def raw_client(url: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    return sock


def ask_raw(sock: zmq.Socket, message: dict | list[bytes], timeout: float = 5) -> dict | None:
    sock.send_multipart(message if isinstance(message, list) else [m.encode(message)])
    if not sock.poll(int(timeout * 1000)):
        return None
    return json.loads(sock.recv())


METADATA = m.metadata_to_wire(LMCacheEngineMetadata("test-model", 1, 0, "vllm", torch.bfloat16,
                                                   (2, 2, 8, 2, 4)))


def hello(sock: zmq.Socket, pid: int | None) -> dict:
    reply = ask_raw(sock, {"op": "hello", "id": 1, "pid": pid, "name": "raw", "metadata": METADATA})
    assert reply is not None and reply["ok"], reply
    return reply


# ---- sharing ------------------------------------------------------------------------------------

def test_what_one_engine_stored_is_a_hit_for_another_with_one_copy(server, workers):
    a, b = workers.start(2)
    a.ask("store", tokens=DOC, seed=1)
    used = server.get("/stats")["arena"]["used_bytes"]
    assert used == 8 * CHUNK_BYTES
    assert b.ask("lookup", tokens=DOC) == {"hit": 64}
    assert b.ask("retrieve", tokens=DOC, seed=1) == {"hit": 64, "exact": True}
    b.ask("store", tokens=DOC, seed=1)  # held already: nothing reserved, nothing copied again
    stats = server.get("/stats")
    assert stats["arena"]["used_bytes"] == used
    by_name = {e["pid"]: e for e in stats["engines"].values()}
    assert by_name[b.proc.pid].get("reserved", 0) == 0
    assert by_name[a.proc.pid]["committed"] == 8
    assert a.ask("retrieve", tokens=DOC[:40], seed=1) == {"hit": 40, "exact": True}
    a.close(), b.close()


def test_a_prefix_of_another_engines_prompt_is_served_and_a_longer_one_only_up_to_it(server, workers):
    a, b = workers.start(2)
    a.ask("store", tokens=DOC[:32], seed=2)
    assert b.ask("retrieve", tokens=DOC, seed=2) == {"hit": 32, "exact": True}
    a.close(), b.close()


# ---- engine faults ------------------------------------------------------------------------------

def test_an_engine_killed_holding_slots_and_reads_is_reaped_and_its_memory_reclaimed(server, workers):
    a, b = workers.start(2)
    a.ask("store", tokens=DOC, seed=3)
    committed = server.get("/stats")["arena"]["used_bytes"]
    assert b.ask("reserve", n=5) == {"slots": 5}
    assert b.ask("hold", tokens=DOC) == {"held": 8}
    engine = next(e for e in server.get("/stats")["engines"].values() if e["pid"] == b.proc.pid)
    assert (engine["slots_reserved"], engine["reads_held"]) == (5, 8)
    assert server.get("/stats")["arena"]["used_bytes"] == committed + 5 * CHUNK_BYTES
    killed = time.monotonic()
    b.kill()
    wait_for(lambda: len(server.get("/stats")["engines"]) == 1, 2 * server.heartbeat)
    assert time.monotonic() - killed <= 2 * server.heartbeat
    stats = server.get("/stats")
    assert stats["arena"]["used_bytes"] == committed
    assert stats["server"]["engines_reaped"] == 1
    assert a.ask("retrieve", tokens=DOC, seed=3) == {"hit": 64, "exact": True}  # never partial, still there
    a.close()


def test_an_engine_that_cannot_be_watched_is_reaped_after_two_missed_heartbeats(server, url):
    sock = raw_client(url)
    att = hello(sock, pid=None)
    ident = {"session": att["session"], "engine": att["engine"]}
    reply = ask_raw(sock, {"op": "reserve", "id": 2, **ident, "shapes": [[2, 2, 8, 8]], "dtype": "bfloat16"})
    silent_from = time.monotonic()  # the server heard from it last just before it answered
    assert reply is not None and len(reply["slots"]) == 1
    assert server.get("/stats")["arena"]["used_bytes"] == CHUNK_BYTES
    wait_for(lambda: not server.get("/stats")["engines"], 10 * server.heartbeat)
    waited = (time.monotonic() - silent_from) / server.heartbeat
    assert 1.95 <= waited <= 3, f"reaped after {waited:.2f} heartbeats"  # 2, give or take the answer's trip
    assert server.get("/stats")["arena"]["used_bytes"] == 0
    reply = ask_raw(sock, {"op": "heartbeat", "id": 3, **ident})
    assert reply is not None and reply["code"] == "engine"
    sock.close()


RAW_KEY = "kv_blob@test-model@1@0@00ff@bfloat16"


def holding_a_slot(url: str) -> tuple[zmq.Socket, dict, dict, int, int]:
    """A raw engine (this process) attached to the server at `url`, holding one reserved slot: its
    socket, the server's hello, its ident fields, the slot and its offset in the arena."""
    sock = raw_client(url)
    att = hello(sock, pid=os.getpid())
    ident = {"session": att["session"], "engine": att["engine"]}
    reply = ask_raw(sock, {"op": "reserve", "id": 2, **ident, "shapes": [[2, 2, 8, 8]], "dtype": "bfloat16"})
    assert reply is not None
    ((slot, offset),) = reply["slots"]
    return sock, att, ident, slot, offset


def test_a_reserved_slot_is_invisible_until_committed(server, url):
    sock, att, ident, slot, offset = holding_a_slot(url)
    key = RAW_KEY
    arena = shm.SharedArena.attach(att["arena"], att["arena_size"])
    arena.tensor[offset: offset + CHUNK_BYTES // 2] = 7  # half written
    assert ask_raw(sock, {"op": "contains", "id": 3, **ident, "keys": [key]})["hits"] == [False]
    assert ask_raw(sock, {"op": "get", "id": 4, **ident, "keys": [key]})["objs"] == []
    ask_raw(sock, {"op": "commit", **ident, "slots": [slot], "keys": [key]}, timeout=0.2)
    assert ask_raw(sock, {"op": "contains", "id": 5, **ident, "keys": [key]})["hits"] == [True]
    ask_raw(sock, {"op": "bye", **ident}, timeout=0.2)
    arena.close()
    sock.close()


def test_a_commit_with_a_malformed_text_is_refused_and_its_slot_stays_the_engines(server, url):
    sock, _, ident, slot, _ = holding_a_slot(url)
    key = RAW_KEY

    def ids(*tokens: int) -> str:
        return base64.b64encode(struct.pack(f"<{len(tokens)}q", *tokens)).decode()

    ok = ids(1, 2)
    too_long = base64.b64encode(bytes(8 * (m.MAX_TEXT_TOKENS + 1))).decode()
    for texts in ("ab", [None, None], [[None, ""]], [[None, ids(-1)]], [[None, [1, 2]]], [[None, "!!!!"]],
                  [[None, base64.b64encode(b"1234567").decode()]], [[None, too_long]], [[7, ok]], [["", ok]],
                  [["f" * 4097, ok]], [[None, ok, 2]]):
        commit = {"op": "commit", "id": 3, **ident, "slots": [slot], "keys": [key], "texts": texts}
        reply = ask_raw(sock, commit)
        assert reply is not None and reply["ok"] is False and "text" in reply["error"], (texts, reply)
    assert ask_raw(sock, {"op": "contains", "id": 4, **ident, "keys": [key]})["hits"] == [False]
    (engine,) = server.get("/stats")["engines"].values()
    assert engine["slots_reserved"] == 1 and "committed" not in engine  # counts show from 1 on
    commit = {"op": "commit", **ident, "slots": [slot], "keys": [key], "texts": [["00fe", ids(*[1] * 8)]]}
    ask_raw(sock, commit, timeout=0.2)  # a notification: no answer
    assert ask_raw(sock, {"op": "contains", "id": 6, **ident, "keys": [key]})["hits"] == [True]
    ask_raw(sock, {"op": "bye", **ident}, timeout=0.2)
    sock.close()


def test_a_commit_naming_a_slot_twice_is_refused_and_the_slot_stays_the_engines(server, url):
    sock, _, ident, slot, _ = holding_a_slot(url)
    other = RAW_KEY.replace("00ff", "00fe")
    reply = ask_raw(sock, {"op": "commit", "id": 3, **ident, "slots": [slot, slot], "keys": [RAW_KEY, other]})
    assert reply is not None and (reply["ok"], reply["code"]) == (False, "bad"), reply
    (engine,) = server.get("/stats")["engines"].values()
    assert engine["slots_reserved"] == 1
    contains = ask_raw(sock, {"op": "contains", "id": 4, **ident, "keys": [RAW_KEY, other]})
    assert contains["hits"] == [False, False]
    ask_raw(sock, {"op": "bye", **ident}, timeout=0.2)
    wait_for(lambda: not server.get("/stats")["engines"], 5)
    assert server.get("/stats")["arena"]["used_bytes"] == 0  # the engine left: its slot came back
    sock.close()


# ---- server faults ------------------------------------------------------------------------------

def test_engines_answer_while_the_server_is_dead_and_attach_again_to_a_new_one(url, workers):
    server = CacheServerProcess(url).start()
    a, b = workers.start(2, timeout=OUTAGE)
    a.ask("store", tokens=DOC, seed=4)
    assert a.ask("faults") == {"failures": 0, "skipped": 0}
    old = segments()
    server.stop(signal.SIGKILL)
    assert a.ask("store", tokens=DOC[:16], seed=5, timeout=10) == {"stored": True}
    assert a.ask("retrieve", tokens=DOC, seed=4, timeout=10) == {"hit": 0, "exact": True}
    assert b.ask("lookup", tokens=DOC, timeout=10) == {"hit": 0}
    assert a.ask("attached") == {"attached": False}
    away = a.ask("faults")
    # one failed request at most (a heartbeat may notice the outage first: not a request, not
    # counted); every request after it not made
    assert away["failures"] <= 1 and away["skipped"] >= 2, away
    server = CacheServerProcess(url).start()
    try:
        assert not old & segments(), "the new server removes the dead one's arena"
        a.wait_attached()
        b.wait_attached()
        a.ask("store", tokens=DOC, seed=6)
        assert b.ask("retrieve", tokens=DOC, seed=6) == {"hit": 64, "exact": True}
        assert a.ask("retrieve", tokens=DOC, seed=6) == {"hit": 64, "exact": True}
        assert a.ask("faults") == away  # back: nothing more counted
    finally:
        logs, _ = close_then_stop(server, a, b)
    warnings = [line for line in logs.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "cache server" in warnings[0], logs


def test_a_server_restart_between_heartbeats_is_noticed_by_its_session(url, workers):
    # No heartbeat comes in between, however slowly the test runs: one that met the restart would
    # detach the engine unnoticed (a heartbeat is not a request), and its stores were skipped.
    server = CacheServerProcess(url, heartbeat=SLOW_HEARTBEAT).start()
    a, b = workers.start(2, timeout=OUTAGE)
    assert a.ask("reserve", n=2) == {"slots": 2}  # slots of the first server, held across the restart
    server.stop(signal.SIGKILL)
    server = CacheServerProcess(url, heartbeat=SLOW_HEARTBEAT).start()
    try:
        a.ask("store", tokens=DOC, seed=7)  # one failed exchange, then attached to the new server
        a.ask("store", tokens=DOC, seed=7)
        assert a.ask("faults") == {"failures": 1, "skipped": 0}  # the exchange was asked again
        assert b.ask("retrieve", tokens=DOC, seed=7) == {"hit": 64, "exact": True}
        stats = server.get("/stats")
        assert stats["arena"]["used_bytes"] == 8 * CHUNK_BYTES  # the old slots never reached it
    finally:
        logs, _ = close_then_stop(server, a, b)
    warnings = [line for line in logs.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "the cache server at" in warnings[0], logs


def test_an_engine_that_timed_out_on_a_stalled_server_gives_back_what_its_old_attachment_held(
        server, workers):
    a = workers(timeout=OUTAGE)
    a.ask("store", tokens=DOC, seed=11)
    assert a.ask("hold", tokens=DOC) == {"held": 8}
    os.kill(server.proc.pid, signal.SIGSTOP)  # answers nothing for longer than the engine waits
    try:
        assert a.ask("lookup", tokens=DOC, timeout=30) == {"hit": 0}
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    a.wait_attached()
    engines = server.get("/stats")["engines"].values()
    assert sorted(e["reads_held"] for e in engines) == [0, 8]  # the old attachment still holds its reads
    assert a.ask("drop") == {"dropped": 8}
    wait_for(lambda: len(server.get("/stats")["engines"]) == 1, 10)
    (engine,) = server.get("/stats")["engines"].values()
    assert engine["pid"] == a.proc.pid and engine["reads_held"] == 0
    assert a.ask("retrieve", tokens=DOC, seed=11) == {"hit": 64, "exact": True}
    a.close()


def test_an_engine_closes_at_once_while_its_heartbeat_waits_on_a_stalled_server(server, workers):
    a = workers()  # would wait PATIENT seconds for an answer
    a.ask("store", tokens=DOC, seed=13)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(4 * server.heartbeat)  # a heartbeat is in flight, unanswered
        log = a.close()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    closing = float(re.search(r"engine closed in ([\d.]+) s", log)[1])  # not the process's exit
    assert closing < PATIENT / 10, log
    assert "failed" not in log, log  # closing is not an outage of the server
    wait_for(lambda: not server.get("/stats")["engines"], 10)  # its goodbye was sent all the same


def test_raw_requests_naming_an_old_session_are_refused(url):
    first = CacheServer(url, 1 << 20, heartbeat=0.25)
    session = first.session
    first.close()
    second = CacheServer(url, 1 << 20, heartbeat=0.25)
    loop = threading.Thread(target=second.serve_forever)
    loop.start()
    sock = raw_client(url)
    try:
        engine = hello(sock, pid=os.getpid())["engine"]
        reply = ask_raw(sock, {"op": "contains", "id": 2, "session": session, "engine": engine, "keys": []})
        assert reply is not None and (reply["ok"], reply["code"]) == (False, "session")
    finally:
        sock.close()
        second.stop()
        loop.join()
        second.close()


def test_a_server_with_a_long_heartbeat_stops_soon_on_sigterm(url):
    """Its loop waits a quarter heartbeat for messages (150 s here) but looks every second whether
    SIGTERM asked it to stop."""
    server = CacheServerProcess(url, heartbeat=SLOW_HEARTBEAT).start()
    t0 = time.monotonic()
    assert server.stop() == 0
    assert time.monotonic() - t0 < 20  # mostly the interpreter's exit, slow on a starved machine


def test_a_second_server_on_the_same_socket_is_refused(url):
    first = CacheServer(url, 1 << 20)
    try:
        with pytest.raises(ValueError, match="another LMCache cache server"):
            CacheServer(url, 1 << 20)
    finally:
        first.close()


# ---- a full L1 ----------------------------------------------------------------------------------

def test_a_full_l1_drops_stores_at_once(url, workers):
    server = CacheServerProcess(url, size_gb=16 * CHUNK_BYTES / (1 << 30)).start()
    try:
        a, b = workers.start(2)
        a.ask("store", tokens=DOC + [d + 100 for d in DOC], seed=8)  # 16 chunks: full
        assert a.ask("hold", tokens=DOC + [d + 100 for d in DOC]) == {"held": 16}  # nothing evictable
        t0 = time.monotonic()
        assert b.ask("store", tokens=[d + 500 for d in DOC], seed=9) == {"stored": True}
        assert time.monotonic() - t0 < 2
        assert b.ask("lookup", tokens=[d + 500 for d in DOC]) == {"hit": 0}
        engine = next(e for e in server.get("/stats")["engines"].values() if e["pid"] == b.proc.pid)
        assert engine["reserve_full"] >= 1
        assert b.ask("retrieve", tokens=DOC, seed=8) == {"hit": 64, "exact": True}
        a.close(), b.close()
    finally:
        server.stop()


def test_a_prompt_larger_than_l1_stores_its_leading_chunks_and_the_engine_stays_attached(url, workers):
    server = CacheServerProcess(url, size_gb=8 * CHUNK_BYTES / (1 << 30)).start()
    try:
        a = workers()
        prompt = DOC + [d + 100 for d in DOC]  # 16 chunks, in one reserve; L1 holds 8
        assert a.ask("store", tokens=prompt, seed=16) == {"stored": True}
        assert a.ask("attached") == {"attached": True}
        assert a.ask("faults") == {"failures": 0, "skipped": 0}
        assert a.ask("retrieve", tokens=prompt, seed=16) == {"hit": 64, "exact": True}
        a.close()
    finally:
        server.stop()


def test_a_reserve_for_more_than_l1_gets_the_leading_slots_and_one_larger_than_l1_nothing(url):
    server = CacheServerProcess(url, size_gb=8 * CHUNK_BYTES / (1 << 30)).start()
    sock = raw_client(url)
    try:
        att = hello(sock, pid=os.getpid())
        ident = {"session": att["session"], "engine": att["engine"]}
        fit = att["arena_size"] // CHUNK_BYTES
        chunk = [2, 2, 8, 8]

        def reserve(*shapes: list[int]) -> dict:
            reply = ask_raw(sock, {"op": "reserve", "id": 2, **ident, "shapes": list(shapes),
                                   "dtype": "bfloat16"})
            assert reply is not None
            return reply

        for shapes in ([chunk, [2, 2, 8, 8 * (fit + 1)]],  # the second is larger than the arena
                       [chunk, chunk, [2**25, 2**39]]):  # 2**64 elements: torch's numel() wraps to 0
            reply = reserve(*shapes)
            assert (reply["ok"], reply["code"]) == (False, "bad") and "arena" in reply["error"], reply
            assert server.get("/stats")["arena"]["used_bytes"] == 0
        reply = reserve(*[chunk] * (fit + 2))  # a prompt longer than L1: what fits is stored
        assert reply["ok"] and len(reply["slots"]) == fit
        (engine,) = server.get("/stats")["engines"].values()
        assert (engine["slots_reserved"], engine["reserve_full"]) == (fit, 2)
        ask_raw(sock, {"op": "bye", **ident}, timeout=0.2)
        wait_for(lambda: not server.get("/stats")["engines"], 5)
        assert server.get("/stats")["arena"]["used_bytes"] == 0
    finally:
        sock.close()
        server.stop()


def test_models_sharing_a_full_l1_evict_each_others_least_recently_used_chunks(url, workers):
    """The arena is full of model A's chunks; model B's store evicts A's least recently used ones
    (A's other chunks and what A reads stay)."""
    server = CacheServerProcess(url, size_gb=16 * CHUNK_BYTES / (1 << 30)).start()
    try:
        a, b = workers(model="model-a"), workers(model="model-b")
        old, recent = DOC, [d + 100 for d in DOC]
        a.ask("store", tokens=old, seed=13)
        a.ask("store", tokens=recent, seed=14)  # 16 chunks: the arena is full
        assert a.ask("retrieve", tokens=old[:32], seed=13) == {"hit": 32, "exact": True}  # used again
        assert b.ask("store", tokens=[d + 500 for d in DOC], seed=15) == {"stored": True}
        assert b.ask("retrieve", tokens=[d + 500 for d in DOC], seed=15) == {"hit": 64, "exact": True}
        # LRU: old's last 4 chunks (never read), then recent's first 4 went; what A read stayed
        assert a.ask("retrieve", tokens=old, seed=13) == {"hit": 32, "exact": True}
        assert a.ask("lookup", tokens=recent) == {"hit": 0}
        models = server.get("/stats")["models"]
        chunks = {label.split(":")[0]: tiers["Hot"]["chunks"] for label, tiers in models.items()}
        evicted = {label.split(":")[0]: tiers["Hot"]["evicted"] for label, tiers in models.items()}
        assert (chunks, evicted) == ({"model-a": 8, "model-b": 8}, {"model-a": 8, "model-b": 0})
        a.close(), b.close()
    finally:
        server.stop()


# ---- bad input ----------------------------------------------------------------------------------

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
JSONISH = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
REQUESTS = st.fixed_dictionaries({"op": st.sampled_from(sorted(m.OPS)), "id": st.integers(0, 2**31)},
                                 optional={"session": st.text(max_size=40), "engine": st.text(max_size=20),
                                           "keys": JSONISH, "shapes": JSONISH, "dtype": JSONISH,
                                           "slots": JSONISH, "reads": JSONISH, "metadata": JSONISH,
                                           "lease": JSONISH, "ttl": JSONISH, "pid": JSONISH, "name": JSONISH,
                                           "texts": JSONISH})
FRAMES = st.one_of(st.lists(st.binary(max_size=64), min_size=1, max_size=3),
                   JSONISH.map(lambda v: [json.dumps(v).encode()]),
                   REQUESTS.map(lambda r: [m.encode(r)]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=FRAMES)
def test_malformed_control_messages_get_an_error_and_the_server_keeps_serving(served, frames):
    sock, ident = served
    reply = ask_raw(sock, frames, timeout=5)
    assert reply is not None and reply["ok"] is False and reply["error"], reply
    assert reply["code"] != "internal", reply  # a malformed request is not the server's failure
    beat = ask_raw(sock, {"op": "heartbeat", "id": 7, **ident})
    assert beat is not None and (beat["ok"], beat["id"]) == (True, 7)


@pytest.mark.parametrize("body", [b'{"op": "heartbeat", "id": ' + b"1" * 5000 + b"}",
                                  b"[" * 100_000 + b"]" * 100_000],
                         ids=["more-digits-than-python-ints-take", "nested-deeper-than-json-recurses"])
def test_json_that_python_will_not_parse_is_a_bad_request(served, body):
    sock, ident = served
    reply = ask_raw(sock, [body])
    assert reply is not None and (reply["ok"], reply["code"]) == (False, "bad"), reply
    beat = ask_raw(sock, {"op": "heartbeat", "id": 8, **ident})
    assert beat is not None and beat["ok"]


@pytest.mark.parametrize("request_", [
    {"op": ["heartbeat"], "id": 9}, {"op": {"heartbeat": 1}, "id": 9},
    {"op": "hello", "id": 9, "pid": None, "name": "raw",
     "metadata": {**METADATA, "kv_shape": [2, 2, float("inf"), 2, 4]}},
], ids=["op-a-list", "op-an-object", "an-infinite-kv-shape"])
def test_a_request_with_a_field_python_cannot_take_is_a_bad_request(served, request_):
    sock, ident = served
    reply = ask_raw(sock, {**request_, **ident})
    assert reply is not None and (reply["ok"], reply["code"]) == (False, "bad"), reply
    beat = ask_raw(sock, {"op": "heartbeat", "id": 10, **ident})
    assert beat is not None and beat["ok"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    url = f"ipc://{tmp_path_factory.mktemp('cs')}/cache.sock"
    server = CacheServerProcess(url, heartbeat=5).start()
    sock = raw_client(url)
    att = hello(sock, pid=os.getpid())
    yield sock, {"session": att["session"], "engine": att["engine"]}
    sock.close()
    server.stop()


# ---- operations ---------------------------------------------------------------------------------

def test_health_stats_metrics_lookup_and_clear_and_the_cli_against_the_server(server, workers):
    a = workers()
    a.ask("store", tokens=DOC, seed=10)
    assert server.get("/health")["status"] == "ok"
    stats = server.get("/stats")
    (engine,) = stats["engines"].values()
    assert engine["committed"] == 8 and engine["watched"] is True
    (model,) = stats["models"]
    assert stats["models"][model]["Hot"]["chunks"] == 8
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'lmcache_server:engine_committed_total{engine="' in metrics
    assert f'lmcache_server:tier_chunks{{model="{model}",tier="Hot"}} 8.0' in metrics
    assert 'lmcache_server:arena_bytes{kind="used"} ' + f"{8 * CHUNK_BYTES}.0" in metrics

    def post(path: str, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(server.http + path, data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert post("/lookup", json.dumps({"tokens": DOC[:20]}).encode()) == (
        200, {"tokens": 20, "models": {model: {"cached_tokens": 16, "tiers": {"Hot": 16}}}})
    assert post("/lookup", b"{not json")[0] == 400
    assert post("/clear", b'{"tier": "nope"}')[0] == 400
    cli = subprocess.run([sys.executable, "-m", "lmcache.cli", "stats", "--url", server.http],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert cli.returncode == 0 and json.loads(cli.stdout)["session"] == stats["session"]
    assert post("/clear", b'{"tier": "hot"}') == (200, {"cleared": {model: {"Hot": 8}}})
    assert a.ask("lookup", tokens=DOC) == {"hit": 0}
    a.close()


def test_a_pin_through_the_operations_endpoint_and_the_cli_keeps_a_prefix_in_a_full_l1(url, workers):
    server = CacheServerProcess(url, size_gb=16 * CHUNK_BYTES / (1 << 30)).start()
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def cli(*args: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "lmcache.cli", *args, "--url", server.http],
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    try:
        a = workers()
        a.ask("store", tokens=DOC, seed=16)
        pinned = cli("pin", "--tokens", ",".join(map(str, DOC)), "--ttl", "600")
        (model,) = pinned["models"]
        assert pinned["models"] == {model: 64}
        for k, seed in ((1, 17), (2, 18)):  # 16 more chunks through a 16-chunk L1
            a.ask("store", tokens=[d + 100 * k for d in DOC], seed=seed)
        assert a.ask("retrieve", tokens=DOC, seed=16) == {"hit": 64, "exact": True}
        assert a.ask("lookup", tokens=[d + 100 for d in DOC]) == {"hit": 0}  # evicted instead
        assert cli("unpin", "--lease", pinned["lease"]) == {"released": pinned["lease"]}
        a.ask("store", tokens=[d + 300 for d in DOC], seed=19)
        a.ask("store", tokens=[d + 400 for d in DOC], seed=20)
        assert a.ask("lookup", tokens=DOC) == {"hit": 0}  # no longer pinned: evicted
        request = urllib.request.Request(server.http + "/pin", data=b'{"text": "hello"}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400 and "no tokenizer" in json.loads(refused.value.read())["error"]
        a.close()
    finally:
        server.stop()


def test_engines_attach_over_tcp_too(workers):
    url = f"tcp://127.0.0.1:{free_port()}"
    server = CacheServerProcess(url).start()
    try:
        a, b = workers.start(2, url)
        a.ask("store", tokens=DOC, seed=12)
        assert b.ask("retrieve", tokens=DOC, seed=12) == {"hit": 64, "exact": True}
        a.close(), b.close()
    finally:
        server.stop()


@pytest.fixture
def slow_remote(tmp_path):
    """A real Valkey behind 0.5 s of round-trip time (`LatencyProxy`) and the server config that
    makes it the server's remote tier."""
    from tests.helpers.servers import LatencyProxy, Valkey

    valkey = Valkey(tmp_path).start()
    proxy = LatencyProxy(valkey.port, rtt=0.5)
    config = tmp_path / "slow-remote.yaml"
    config.write_text(json.dumps({"remote_url": f"redis://{proxy.url}", "remote_timeout": 10}))
    yield config
    proxy.close()
    valkey.kill()


def test_a_load_from_a_slow_lower_tier_does_not_hold_up_other_engines(url, workers, slow_remote):
    """The server's remote tier is a real Valkey behind 0.5 s of round-trip time: while one
    engine's load waits on it, another engine is answered at once."""
    server = CacheServerProcess(url, "--config", str(slow_remote)).start()
    sock = raw_client(url)
    try:
        att = hello(sock, pid=os.getpid())
        ident = {"session": att["session"], "engine": att["engine"]}
        key = "kv_blob@test-model@1@0@00ff@bfloat16"  # connects the server to Valkey (a few round trips)
        reply = ask_raw(sock, {"op": "contains", "id": 2, **ident, "keys": [key]}, timeout=10)
        assert reply is not None and reply["hits"] == [False]
        a = workers()
        a.ask("store", tokens=DOC, seed=13)
        wait_for(lambda: next(iter(server.get("/stats")["models"].values()))["RemoteBackend"]
                 .get("bytes_written", 0) == 8 * CHUNK_BYTES, 30, step=0.1)
        urllib.request.urlopen(urllib.request.Request(server.http + "/clear", data=b'{"tier": "hot"}'),
                               timeout=10).read()
        assert a.proc.stdin is not None
        a.proc.stdin.write(json.dumps({"op": "retrieve", "tokens": DOC, "seed": 13}) + "\n")
        a.proc.stdin.flush()  # its load now waits on the remote tier
        time.sleep(0.1)
        t0 = time.monotonic()
        beat = ask_raw(sock, {"op": "heartbeat", "id": 3, **ident})
        answered_in = time.monotonic() - t0
        assert beat is not None and beat["ok"]
        assert answered_in < 0.2, f"held up {answered_in:.2f} s by another engine's load"
        assert a._line(30) == {"hit": 64, "exact": True}
        a.close()
    finally:
        sock.close()
        server.stop()


def test_two_cache_servers_share_chunks_as_peers(tmp_path, workers):
    """Two hosts' cache servers with the peer tier behind their L1s (one Valkey for registrations):
    what an engine stored on one server is a full, exact hit for an engine on the other, pulled
    from the first server's peer server into the second's L1, where it stays when the first dies."""
    from tests.helpers.servers import Valkey

    valkey = Valkey(tmp_path).start()
    config = tmp_path / "tiers.yaml"
    config.write_text(json.dumps({"enable_p2p": True, "lookup_url": f"redis://127.0.0.1:{valkey.port}",
                                  "distributed_url": "127.0.0.1:0", "p2p_ttl": 5, "remote_timeout": 5}))
    urls = [f"ipc://{tmp_path}/cache-{i}.sock" for i in (1, 2)]
    servers = [CacheServerProcess(u, "--config", str(config)).start() for u in urls]
    try:
        a, b = workers(urls[0]), workers(urls[1])
        a.ask("store", tokens=DOC, seed=21)
        wait_for(lambda: b.ask("lookup", tokens=DOC) == {"hit": 64}, 20, step=0.2)  # registered
        assert b.ask("retrieve", tokens=DOC, seed=21) == {"hit": 64, "exact": True}
        (model,) = servers[1].get("/stats")["models"].values()
        assert (model["PeerBackend"]["hits"], model["PeerBackend"]["bytes_read"]) == (8, 8 * CHUNK_BYTES)
        assert model["Hot"]["chunks"] == 8  # promoted into the second server's L1
        servers[0].stop(signal.SIGKILL)
        assert b.ask("retrieve", tokens=DOC, seed=21) == {"hit": 64, "exact": True}
        a.kill()
        b.close()
    finally:
        for s in servers:
            if s.proc is not None and s.proc.poll() is None:
                s.stop()
        shm.remove_stale()  # the killed server's arena (what its successor would remove)
        valkey.kill()


# ---- operations never stall serving -------------------------------------------------------------

def test_an_engines_requests_are_not_held_up_by_operator_lookups_against_a_slow_remote(url, slow_remote):
    """An operator's lookup waits on the server's remote tier (0.5 s round trips) for every chunk;
    an attached engine's stores, retrieves and leased lookups meanwhile take as long as without
    it (medians, interleaved rounds; see `tests.helpers.ops_load`)."""
    from tests.helpers.ops_load import EngineRequests, interleaved_rounds, operator_lookup
    from tests.unit.cache_server.engine_worker import build

    server = CacheServerProcess(url, "--config", str(slow_remote)).start()
    engine = None
    try:
        engine = build(url, heartbeat_timeout=10)  # the server's first remote calls connect
        requests = EngineRequests(engine, DOC)
        requests.prepare(seed=30)
        cold = [d + 5000 for d in DOC]  # never stored: the operator's lookup asks the remote tier
        (answer,) = operator_lookup(server.http, cold)["models"].values()
        assert answer == {"cached_tokens": 0, "tiers": {"Hot": 0, "RemoteBackend": 0}}
        rounds = interleaved_rounds(server.http, requests, cold, rounds=6, per_op=3)
        assert min(rounds.operator) >= 0.5, "the operator's lookups did not wait on the remote tier"
        assert rounds.overlapped, "the engine's requests ended after the operator's lookup"
        added = rounds.added_ms()
        assert added["all"] < 5, f"operator lookups added {added} ms to the engine's requests " \
                                 f"(without: {rounds.medians_ms(False)})"
    finally:
        if engine is not None:
            engine.close()
        server.stop()


def test_clear_and_stats_do_not_wait_on_an_operator_lookup(url, slow_remote):
    """/clear and /stats answer while an operator's lookup waits on the slow remote tier."""
    from tests.helpers.ops_load import operator_lookup

    server = CacheServerProcess(url, "--config", str(slow_remote)).start()
    sock = raw_client(url)
    try:
        hello(sock, pid=os.getpid())  # the model exists: its tiers are made
        cold = [d + 6000 for d in DOC]
        operator_lookup(server.http, cold)  # connects the remote tier
        thread = threading.Thread(target=operator_lookup, args=(server.http, cold))
        t0 = time.monotonic()
        thread.start()
        time.sleep(0.1)
        server.get("/stats")
        request = urllib.request.Request(server.http + "/clear", data=b'{"tier": "hot"}', method="POST")
        urllib.request.urlopen(request, timeout=10).read()
        answered_in = time.monotonic() - t0
        thread.join()
        looked_up_in = time.monotonic() - t0
        assert looked_up_in >= 0.5 and answered_in < 0.4, (answered_in, looked_up_in)
    finally:
        sock.close()
        server.stop()


def test_a_leased_lookup_asks_the_servers_tiers_once(tmp_path, url):
    """An engine's leased lookup (``contains``, then ``lease`` of the prefix it counted) asks the
    server's remote tier (a real Valkey, its EXISTS calls counted by the server itself) no more
    than a lookup without a lease does, and the lease still brings the chunks back into L1 and
    pins them until it is released."""
    import redis

    from tests.helpers.servers import Valkey
    from tests.unit.cache_server.engine_worker import build, kv_cache

    valkey = Valkey(tmp_path).start()
    config = tmp_path / "remote.yaml"
    config.write_text(json.dumps({"remote_url": valkey.url, "remote_timeout": 10}))
    server = CacheServerProcess(url, "--config", str(config)).start()
    engine = None
    counter = redis.Redis(port=valkey.port)
    try:
        engine = build(url)
        tokens = torch.tensor(DOC)
        engine.store(tokens, kvcaches=kv_cache(31))

        def model() -> dict:
            (stats,) = server.get("/stats")["models"].values()
            return stats

        wait_for(lambda: model()["RemoteBackend"].get("bytes_written", 0) == 8 * CHUNK_BYTES, 30, step=0.1)

        def exists_calls_of(lookup) -> int:
            urllib.request.urlopen(urllib.request.Request(server.http + "/clear", data=b'{"tier": "hot"}'),
                                   timeout=10).read()
            before = counter.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
            assert lookup() == len(DOC)
            return counter.info("commandstats")["cmdstat_exists"]["calls"] - before

        plain = exists_calls_of(lambda: engine.lookup(tokens))
        leased = exists_calls_of(lambda: engine.lookup(tokens, lease_id="r1"))
        assert plain == 8 and leased == plain
        wait_for(lambda: model()["Hot"]["chunks"] == 8, 10)  # the lease brought them back
        (attached,) = server.get("/stats")["engines"].values()
        assert attached["leases"] == 1
        engine.release("r1")
        wait_for(lambda: next(iter(server.get("/stats")["engines"].values()))["leases"] == 0, 10)
    finally:
        counter.close()
        if engine is not None:
            engine.close()
        server.stop()
        valkey.kill()


# ---- KV events ----------------------------------------------------------------------------------

def test_a_router_watching_the_servers_events_finds_the_prefix_its_lookup_reports(tmp_path, url):
    """``lmcache router --shared-kv-events``: the index the router builds from a real server's events
    gives each prompt the prefix the server's engines look up (whole chunks: a shorter prompt, one
    that goes on past the stored text, other text, each tenant's salt), and after a clear none,
    within a second."""
    from lmcache.chunk_hash import extra_key_of
    from lmcache.router.watch import KVWatch
    from tests.unit.cache_server.engine_worker import CHUNK, build, kv_cache

    endpoint = f"ipc://{tmp_path}/events.sock"
    server = CacheServerProcess(url, "--kv-events", endpoint).start()
    watch = KVWatch((), (), None, shared=(endpoint,))
    engine = None
    try:
        engine = build(url)
        time.sleep(0.2)  # the subscription reaches the server's socket (ZMQ drops what precedes it)
        engine.store(torch.tensor(DOC), kvcaches=kv_cache(41))
        engine.store(torch.tensor(DOC[:40]), kvcaches=kv_cache(42), extra_key=extra_key_of("tenant-b"))
        prompts = {"stored": (DOC, None), "shorter": (DOC[:29], None), "longer": (DOC + [7] * 20, None),
                   "other text": ([5, *DOC[1:]], None), "tenant b": (DOC, "tenant-b"),
                   "tenant c": (DOC, "tenant-c")}
        looked_up = {name: engine.lookup(torch.tensor(t), extra_key=extra_key_of(salt)) // CHUNK * CHUNK
                     for name, (t, salt) in prompts.items()}
        assert looked_up == {"stored": 64, "shorter": 24, "longer": 64, "other text": 0, "tenant b": 40,
                             "tenant c": 0}

        def matched() -> dict[str, int]:
            return {name: watch.shared.match(t, extra_key_of(salt)).tokens
                    for name, (t, salt) in prompts.items()}

        wait_for(lambda: matched() == looked_up, 10)
        cleared = time.monotonic()
        urllib.request.urlopen(urllib.request.Request(server.http + "/clear", data=b'{"tier": "hot"}'),
                               timeout=10).read()
        wait_for(lambda: not any(matched().values()), 5)
        assert time.monotonic() - cleared < 1.0
        assert watch.subscribers[0].counts()["malformed"] == 0
    finally:
        watch.close()
        if engine is not None:
            engine.close()
        server.stop()


def test_the_servers_tiers_are_published_as_kv_events_and_a_clear_within_a_second(tmp_path, url):
    """With ``--kv-events`` a subscriber decoding with vLLM's classes sees each stored chunk in
    L1 ("CPU") and on disk ("STORAGE") as the server's lookup does, and finds a prompt's prefix by
    its token ids and parent chain as it finds vLLM's blocks (a store of a masked prompt too; a
    trailing partial chunk is no block); a clear of L1 within a second on an idle server, and
    malformed control messages are still answered."""
    pytest.importorskip("vllm")
    from tests.helpers.kv_events import Subscriber
    from tests.unit.cache_server.engine_worker import CHUNK, build, kv_cache

    sub = Subscriber()
    config = tmp_path / "disk.yaml"
    config.write_text(json.dumps({"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}))
    server = CacheServerProcess(url, "--config", str(config), "--kv-events", sub.endpoint).start()
    engine = None
    try:
        engine = build(url)
        tokens = torch.tensor(DOC)
        engine.store(tokens, kvcaches=kv_cache(41))
        chunks = [bytes.fromhex(h) for h in engine.token_database.chunk_hashes(tokens)]
        wait_for(lambda: sub.leading(chunks, "CPU") == sub.leading(chunks, "STORAGE") == 8, 10)
        assert sub.prefix(DOC, "CPU", CHUNK) == sub.prefix(DOC, "STORAGE", CHUNK) == 64

        other = DOC[:32] + [d + 100 for d in DOC[32:]] + [5, 6, 7]
        engine.store(torch.tensor(other), torch.tensor([False] * 32 + [True] * 35), kvcaches=kv_cache(43))
        wait_for(lambda: sub.prefix(other, "CPU", CHUNK) == sub.prefix(other, "STORAGE", CHUNK) == 64, 10)
        partial = bytes.fromhex(engine.token_database.chunk_hashes(torch.tensor(other))[-1])
        with sub.lock:
            assert not any(partial in held for held in sub.held.values())
        (model,) = server.get("/stats")["models"]
        lookup = urllib.request.Request(server.http + "/lookup", data=json.dumps({"tokens": DOC}).encode())
        with urllib.request.urlopen(lookup, timeout=10) as response:
            tiers = json.loads(response.read())["models"][model]["tiers"]
        assert tiers == {"Hot": 64, "LocalDiskBackend": 64}

        cleared = time.monotonic()
        urllib.request.urlopen(urllib.request.Request(server.http + "/clear", data=b'{"tier": "hot"}'),
                               timeout=10).read()
        wait_for(lambda: sub.leading(chunks, "CPU") == 0, 5)
        assert time.monotonic() - cleared < 1.0
        assert sub.leading(chunks, "STORAGE") == 8

        sock = raw_client(url)
        for frames in ([b"\xff\x00garbage"], [m.encode({"op": "get", "id": 1, "keys": 5})]):
            reply = ask_raw(sock, frames)
            assert reply is not None and reply["ok"] is False and reply["error"]
        sock.close()
        assert engine.lookup(tokens) == len(DOC)  # served from disk, as before
        with sub.lock:
            assert sub.undecodable == 0 and sub.seqs == list(range(len(sub.seqs)))
    finally:
        if engine is not None:
            engine.close()
        server.stop()
        sub.close()
