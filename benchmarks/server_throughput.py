"""The cache server (`lmcache cache-server`) against the engine's own hot tier, on one machine in
one run: store/retrieve throughput, the server's memory with idle engines attached, and how it
copes with processes that die.

1. Throughput. One request's KV (default SmolLM2-135M-shaped: 30 layers, 3 KV heads x 64, fp32,
   256-token chunks; a `--tokens`-token request in a vLLM-v1 paged cache on CPU, per layer
   [2, num_blocks, 16, 3, 64], its blocks scattered) is stored with `engine.store(tokens,
   kvcaches=..., slot_mapping=...)` and loaded back with `engine.retrieve(...)` into an empty cache
   of the same shape, by three engines built alike: one attached to a cache server (a subprocess
   started with the CLI on a temporary ipc socket; its L1 is the server's shared-memory arena), one
   attached to a second server that publishes KV events (``--kv-events``: each commit then carries
   the chunks' token ids, which the engine computes), one with its in-process hot tier
   (`MixedMemoryAllocator`). Every arena is `--arena-gb` (memory is used as it fills). Each trial
   uses new tokens (a store really stores), empties the tier first (untimed: the arena's memory is
   reused, as in a long-running engine) and zeroes the target cache; each call is timed until its
   copies completed (`engine._copies.wait_idle`; the server's commits are notifications it handles
   before the engine's next request). Every retrieved value is checked bit for bit against the
   stored one. `--warmup` untimed trials each, then `--trials` trials of the three in turn, the
   order rotated every trial (with a multiple of 3 trials, each takes every place equally often).
   Reported: median GB/s (bytes = the request's KV), server / in-process ratios of the medians
   (goal >= 0.85), and with events / without.
2. Memory. A new server's resident memory (VmRSS, RssAnon and RssShmem of /proc/<pid>/status)
   and its arena's resident bytes (/stats) with N idle engines attached (`--engines`, separate
   processes that attach and sit idle), read after 4 heartbeats.
3. Faults (server heartbeat `--heartbeat` s):
   a. an engine process holding `--fault-slots` reserved slots is SIGKILLed: the time until /stats
      shows it gone and the arena's used bytes back where they were (the server watches its pid;
      the figure includes the process's own exit, reported beside it);
   b. an engine whose process cannot be watched (a raw ZMQ ``hello`` with ``"pid": null``) reserves
      a slot and goes silent: the time until it is reaped (expected about 2 heartbeats);
   c. an engine serves a stream of `--stream-requests` store+retrieve requests (`--stream-tokens`
      each, one every `--stream-interval` s); the server is SIGKILLed before request `--kill-after`
      and a new one started on the same socket before request `--restart-after`: requests that
      raised (goal 0), requests served from cache before the kill, during the outage and after the
      restart, and the time from the new server serving to the engine being attached again
      (`client.attached`, polled every millisecond); each request's outcome is in the JSON.

Every process and shared-memory segment this run made is gone at its end, also on failure.

    python benchmarks/server_throughput.py [--trials 15] [--warmup 2] [--tokens 4096] [--quick]

`--quick` (1,024-token requests, 5 trials, 1 GB arenas, 0-2 idle engines, a 12-request stream)
checks the whole run in well under a minute; its figures are not the benchmark's.

Writes benchmarks/out/server_throughput.json (server_throughput-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch
import zmq
from machine import cpu_info

from lmcache.cache_engine import LMCacheEngine, _make_allocator
from lmcache.cache_key import dtype_tag
from lmcache.cache_server import messages as m
from lmcache.cache_server.client import CacheServerClient
from lmcache.cache_server.shm import PREFIX, SHM_DIR
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.token_database import ChunkedTokenDatabase

OUT = Path(__file__).parent / "out"
READY = re.compile(r"operations on http://([^\s:]+):(\d+)")
GOAL = 0.85
COPY_TIMEOUT = 60.0

# An engine process that attaches, reserves `slots` slots of `shape` and holds them (0: idle), says
# so on one line, and stays until its stdin closes. argv: url, metadata (wire), slots, shape.
ENGINE_SCRIPT = r"""
import json, sys, torch
from lmcache.cache_server import messages as m
from lmcache.cache_server.client import CacheServerClient
url, wire, slots, shape = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
metadata = m.metadata_field({"op": "hello", "metadata": wire})
client = CacheServerClient(url, metadata, name=f"bench-engine-{slots}")
held = [client.allocate(torch.Size(shape), metadata.kv_dtype) for _ in range(slots)]
print(json.dumps({"attached": client.attached, "slots": sum(o is not None for o in held)}), flush=True)
sys.stdin.read()
client.close()
"""


class BenchmarkFailure(RuntimeError):
    """Something the benchmark checks did not hold (wrong KV, nothing stored, no reaping...)."""


@dataclass(frozen=True)
class ModelShape:
    layers: int = 30
    heads: int = 3
    head_size: int = 64
    dtype: torch.dtype = torch.float32
    chunk: int = 256

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.hidden * self.dtype.itemsize

    def metadata(self) -> LMCacheEngineMetadata:
        return LMCacheEngineMetadata("SmolLM2-135M", 1, 0, "vllm", self.dtype,
                                     (self.layers, 2, self.chunk, self.heads, self.head_size))

    def chunk_shape(self) -> list[int]:
        """A full chunk's memory object: [2, layers, chunk, hidden]."""
        return [2, self.layers, self.chunk, self.hidden]


# ---- processes ----------------------------------------------------------------------------------

class Processes:
    """Every subprocess this run starts, and the shared arenas of the servers among them: `close`
    ends what is still running (SIGKILL, by its own pid) and removes those arenas."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []
        self.server_pids: list[int] = []
        self._logs = itertools.count(1)

    def start(self, argv: list[str], name: str, server: bool = False) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}-{next(self._logs)}.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self.procs.append(proc)
        if server:
            self.server_pids.append(proc.pid)
        return proc, log

    def arenas(self) -> list[Path]:
        return [p for pid in self.server_pids for p in SHM_DIR.glob(f"{PREFIX}-{pid}-*")]

    def close(self) -> list[str]:
        """End everything; the names of arenas that had to be removed here (none after a clean run
        but those of SIGKILLed servers that no later server removed)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        removed = []
        for path in self.arenas():
            path.unlink(missing_ok=True)
            removed.append(path.name)
        return removed


def read_line(proc: subprocess.Popen, timeout: float, what: str, log: Path) -> str:
    """The next line `proc` prints on stdout; BenchmarkFailure if none comes within `timeout`."""
    stdout: IO[bytes] = proc.stdout  # type: ignore[assignment]
    ready, _, _ = select.select([stdout], [], [], timeout)
    line = stdout.readline().decode() if ready else ""
    if not line:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise BenchmarkFailure(f"{what} printed nothing within {timeout:g} s (exit code {proc.poll()}); "
                               f"its stderr ends:\n{tail}")
    return line


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.005) -> float:
    """Poll `check` until true; the seconds it took. BenchmarkFailure after `timeout`."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise BenchmarkFailure(f"{what}: not within {timeout:g} s")
        time.sleep(interval)
    return time.monotonic() - t0


class ServerProcess:
    """`lmcache cache-server` in a subprocess; `started`/`serving`: when it was spawned and when it
    printed its ready line (time.monotonic)."""

    def __init__(self, procs: Processes, url: str, size_gb: float, heartbeat: float, *extra: str) -> None:
        """`extra`: more arguments of ``lmcache cache-server``."""
        self.url, self.heartbeat = url, heartbeat
        self.started = time.monotonic()
        self.proc, self.log = procs.start([sys.executable, "-m", "lmcache.cli", "cache-server", "--url", url,
                                           "--size-gb", f"{size_gb:g}", "--heartbeat", f"{heartbeat:g}",
                                           "--http-port", "0", *extra], "cache-server", server=True)
        line = read_line(self.proc, 120, "the cache server", self.log)
        self.serving = time.monotonic()
        match = READY.search(line)
        if match is None:
            raise BenchmarkFailure(f"unexpected ready line from the cache server: {line!r}")
        self.http = f"http://{match.group(1)}:{match.group(2)}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.http + path, data=data,
                                         headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    def stats(self) -> dict[str, Any]:
        return self._request("/stats")

    def clear(self) -> None:
        self._request("/clear", {"tier": "hot"})

    def engine_of(self, pid: int | None = None, name: str | None = None) -> dict[str, Any] | None:
        for engine in self.stats()["engines"].values():
            if (pid is not None and engine["pid"] == pid) or (name is not None and engine["name"] == name):
                return engine
        return None

    def memory(self) -> dict[str, int]:
        """VmRSS, RssAnon and RssShmem of the server process, in bytes."""
        out = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
        return out

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM: the server gives everything back and removes its arena."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
                raise BenchmarkFailure("the cache server did not stop within 15 s of SIGTERM") from None


class EngineProcess:
    """An engine process on `url` (`ENGINE_SCRIPT`) holding `slots` reserved slots."""

    def __init__(self, procs: Processes, url: str, shape: ModelShape, slots: int = 0) -> None:
        wire = json.dumps(m.metadata_to_wire(shape.metadata()))
        self.proc, self.log = procs.start([sys.executable, "-c", ENGINE_SCRIPT, url, wire, str(slots),
                                           json.dumps(shape.chunk_shape())], "engine")
        self.slots = slots

    def ready(self) -> None:
        said = json.loads(read_line(self.proc, 120, "an engine process", self.log))
        if not said["attached"] or said["slots"] != self.slots:
            raise BenchmarkFailure(f"engine process {self.proc.pid}: {said}, expected attached with "
                                   f"{self.slots} slots")

    def leave(self) -> None:
        """Close its stdin: it detaches (bye) and exits."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


# ---- engines and KV -----------------------------------------------------------------------------

class PagedRequest:
    """A request of `n` tokens in a vLLM-v1 paged cache on CPU (per layer [2, num_blocks, block,
    heads, head_size], random values, blocks scattered) and an empty cache of the same shape to
    retrieve into."""

    def __init__(self, shape: ModelShape, n: int, block: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_blocks = 2 * -(-n // block)
        layer = (2, num_blocks, block, shape.heads, shape.head_size)
        self.src = [torch.randn(layer, generator=gen).to(shape.dtype) for _ in range(shape.layers)]
        self.dst = [torch.zeros(layer, dtype=shape.dtype) for _ in range(shape.layers)]
        blocks = torch.randperm(num_blocks, generator=gen)[: -(-n // block)]
        self.slots = (blocks[:, None] * block + torch.arange(block)).flatten()[:n]
        self.hidden = shape.hidden

    def clear_target(self) -> None:
        for t in self.dst:
            t.zero_()

    def exact(self, mask: torch.Tensor) -> bool:
        """Whether the target holds the source's KV, bit for bit, at the tokens `mask` selects."""
        slots = self.slots[mask]
        return all(torch.equal(s.view(2, -1, self.hidden)[:, slots], d.view(2, -1, self.hidden)[:, slots])
                   for s, d in zip(self.src, self.dst, strict=True))


_seeds = itertools.count(1)


def new_tokens(n: int) -> torch.Tensor:
    """Tokens no engine of this run has seen."""
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(next(_seeds)))


def build_engine(shape: ModelShape, server_url: str | None = None, arena_gb: float = 4.0) -> LMCacheEngine:
    """An engine over a paged CPU cache: on the cache server at `server_url`, else with its own
    hot tier of `arena_gb`."""
    if server_url is not None:
        config = LMCacheEngineConfig.from_defaults(chunk_size=shape.chunk, cache_server_url=server_url)
    else:
        config = LMCacheEngineConfig.from_defaults(chunk_size=shape.chunk, max_local_cpu_size=arena_gb)
    metadata = shape.metadata()
    engine = LMCacheEngine(config, metadata, _make_allocator(config, metadata),
                           ChunkedTokenDatabase(config, metadata),
                           VLLMPagedMemGPUConnectorV2(shape.hidden, shape.layers))
    if server_url is not None and not engine.memory_allocator.available:
        engine.close()
        raise BenchmarkFailure(f"the engine did not attach to the cache server at {server_url}")
    return engine


@dataclass
class Trip:
    store_s: float
    retrieve_s: float
    stored: int  # tokens the store copied into the tier
    mask: torch.Tensor  # tokens retrieved


def store_and_retrieve(engine: LMCacheEngine, request: PagedRequest, tokens: torch.Tensor) -> Trip:
    """Store `tokens` from the request's cache, then retrieve them into its empty target; each
    timed until its copies completed."""
    stored = engine.stats.get("stored_tokens")
    t0 = time.perf_counter()
    engine.store(tokens, kvcaches=request.src, slot_mapping=request.slots)
    if not engine._copies.wait_idle(COPY_TIMEOUT):
        raise BenchmarkFailure("a store's copies did not complete")
    t1 = time.perf_counter()
    mask = engine.retrieve(tokens, kvcaches=request.dst, slot_mapping=request.slots)
    if not engine._copies.wait_idle(COPY_TIMEOUT):
        raise BenchmarkFailure("a retrieve's copies did not complete")
    t2 = time.perf_counter()
    return Trip(t1 - t0, t2 - t1, int(engine.stats.get("stored_tokens") - stored), mask)


# ---- 1. throughput ------------------------------------------------------------------------------

@dataclass
class Throughput:
    tokens: int
    request_bytes: int
    trials: int
    warmup: int
    local_store_gbps: float
    local_retrieve_gbps: float
    server_store_gbps: float
    server_retrieve_gbps: float
    store_ratio: float
    retrieve_ratio: float
    events_store_gbps: float  # through a server publishing KV events (commits carry chunk texts)
    events_retrieve_gbps: float
    events_store_ratio: float  # / the server without events
    events_retrieve_ratio: float


def measure_throughput(args: argparse.Namespace, shape: ModelShape, procs: Processes) -> Throughput:
    n = args.tokens
    request = PagedRequest(shape, n, args.block_size)
    server = ServerProcess(procs, f"ipc://{procs.workdir}/throughput.sock", args.arena_gb, args.heartbeat)
    publishing = ServerProcess(procs, f"ipc://{procs.workdir}/events.sock", args.arena_gb, args.heartbeat,
                               "--kv-events", f"ipc://{procs.workdir}/kv-events.sock")
    engines = {"in-process": build_engine(shape, arena_gb=args.arena_gb),
               "server": build_engine(shape, server.url),
               "server+events": build_engine(shape, publishing.url)}
    empty: dict[str, Callable[[], object]] = {
        "in-process": lambda: engines["in-process"].storage_manager.clear("hot"), "server": server.clear,
        "server+events": publishing.clear}
    times: dict[str, dict[str, list[float]]] = {name: {"store": [], "retrieve": []} for name in engines}
    try:
        for trial in range(-args.warmup, args.trials):  # trials < 0: warm-up, untimed
            order = list(engines)
            names = order[trial % len(order):] + order[: trial % len(order)]  # each in every place in turn
            for name in names:
                empty[name]()
                request.clear_target()
                trip = store_and_retrieve(engines[name], request, new_tokens(n))
                if trip.stored != n or not bool(trip.mask.all()):
                    raise BenchmarkFailure(f"{name}: trial {trial} stored {trip.stored} and retrieved "
                                           f"{int(trip.mask.sum())} of {n} tokens")
                if not request.exact(trip.mask):
                    raise BenchmarkFailure(f"{name}: trial {trial}: the retrieved KV differs from the "
                                           "stored KV")
                if trial >= 0:
                    times[name]["store"].append(trip.store_s)
                    times[name]["retrieve"].append(trip.retrieve_s)
    finally:
        for engine in engines.values():
            engine.close()
        server.stop()
        publishing.stop()
    nbytes = n * shape.bytes_per_token
    gbps = {name: {op: nbytes / statistics.median(t) / 1e9 for op, t in ops.items()}
            for name, ops in times.items()}
    local, remote, events = gbps["in-process"], gbps["server"], gbps["server+events"]
    return Throughput(n, nbytes, args.trials, args.warmup, local["store"], local["retrieve"], remote["store"],
                      remote["retrieve"], remote["store"] / local["store"],
                      remote["retrieve"] / local["retrieve"], events["store"], events["retrieve"],
                      events["store"] / remote["store"], events["retrieve"] / remote["retrieve"])


# ---- 2. memory ----------------------------------------------------------------------------------

@dataclass
class MemoryRow:
    engines: int
    vm_rss: int
    rss_anon: int
    rss_shmem: int
    arena_resident: int
    arena_grown: int


def measure_memory(args: argparse.Namespace, shape: ModelShape, procs: Processes,
                   server: ServerProcess) -> list[MemoryRow]:
    """The server's memory with N idle engines attached, N from `args.engines` (ascending; engines
    are added to those already there)."""
    rows, idle = [], []
    try:
        for n in sorted(args.engines):
            new = [EngineProcess(procs, server.url, shape) for _ in range(n - len(idle))]
            for engine in new:
                engine.ready()
            idle += new
            wait_until(lambda n=n: len(server.stats()["engines"]) == n, 10, f"{n} engines attached")
            time.sleep(4 * server.heartbeat)
            memory, arena = server.memory(), server.stats()["arena"]
            rows.append(MemoryRow(n, memory["VmRSS"], memory["RssAnon"], memory["RssShmem"],
                                  arena["resident_bytes"], arena["grown_bytes"]))
    finally:
        for engine in idle:
            engine.leave()
    wait_until(lambda: not server.stats()["engines"], 10, "idle engines gone")
    return rows


# ---- 3. faults ----------------------------------------------------------------------------------

@dataclass
class Reaping:
    seconds: float  # from the kill (a) or the last message (b) until gone and the memory back
    heartbeats: float
    slots: int
    bytes_held: int
    exit_seconds: float | None = None  # (a): from the kill until the process had exited (waited for)


def killed_engine(args: argparse.Namespace, shape: ModelShape, procs: Processes,
                  server: ServerProcess) -> Reaping:
    """(a) An engine process holding reserved slots is SIGKILLed."""
    base = server.stats()["arena"]["used_bytes"]
    engine = EngineProcess(procs, server.url, shape, slots=args.fault_slots)
    engine.ready()
    seen = server.engine_of(pid=engine.proc.pid)
    held = server.stats()["arena"]["used_bytes"] - base
    if seen is None or seen["slots_reserved"] != args.fault_slots or not seen["watched"] or held <= 0:
        raise BenchmarkFailure(f"the engine holding slots is not as expected in /stats: {seen}, {held} bytes")
    t0 = time.monotonic()
    engine.proc.send_signal(signal.SIGKILL)
    engine.proc.wait(10)
    exited = time.monotonic() - t0
    wait_until(lambda: server.engine_of(pid=engine.proc.pid) is None
               and server.stats()["arena"]["used_bytes"] == base, 30, "the killed engine reaped")
    seconds = time.monotonic() - t0
    return Reaping(seconds, seconds / server.heartbeat, args.fault_slots, held, exited)


def silent_engine(shape: ModelShape, server: ServerProcess) -> Reaping:
    """(b) An engine whose pid the server cannot watch reserves a slot and goes silent."""
    base = server.stats()["arena"]["used_bytes"]
    name = "bench-unwatched"
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.url)

        def ask(request: dict[str, Any]) -> dict[str, Any]:
            sock.send(m.encode(request))
            if not sock.poll(10_000):
                raise BenchmarkFailure(f"no answer to a raw {request['op']}")
            reply = m.decode_reply(sock.recv_multipart())
            if not reply.get("ok"):
                raise BenchmarkFailure(f"raw {request['op']} refused: {reply}")
            return reply

        hello = ask({"op": "hello", "id": 1, "pid": None, "name": name,
                     "metadata": m.metadata_to_wire(shape.metadata())})
        reserved = ask({"op": "reserve", "id": 2, "session": hello["session"], "engine": hello["engine"],
                        "shapes": [list(shape.chunk_shape())], "dtype": dtype_tag(shape.dtype)})
        t0 = time.monotonic()  # last heard from
        seen = server.engine_of(name=name)
        held = server.stats()["arena"]["used_bytes"] - base
        if len(reserved.get("slots", [])) != 1 or seen is None or seen["watched"] \
                or seen["slots_reserved"] != 1:
            raise BenchmarkFailure(f"the unwatched engine is not as expected: {reserved}, {seen}")
        wait_until(lambda: server.engine_of(name=name) is None
                   and server.stats()["arena"]["used_bytes"] == base, 30 * server.heartbeat + 10,
                   "the silent engine reaped")
        seconds = time.monotonic() - t0
    finally:
        sock.close(0)
        context.term()
    return Reaping(seconds, seconds / server.heartbeat, 1, held)


@dataclass
class Restart:
    requests: int
    raised: int
    engine_errors: int
    served_before_kill: str
    served_during_outage: str
    served_after_restart: str
    missed_after_restart_before_attach: int
    slowest_request_ms: dict[str, float]  # per phase: the longest store + retrieve
    detached_after_kill_s: float
    server_start_to_serving_s: float
    serving_to_attached_s: float
    serving_to_attached_heartbeats: float
    killed_at_s: float  # when the server was killed, from the first request's start
    timeline: list[dict[str, Any]]  # per request: start_s (from the first request's), phase, hit, ms


class AttachmentWatch(threading.Thread):
    """Polls `client.attached` every millisecond from its start (the kill): when it turned False,
    then True again (time.monotonic)."""

    def __init__(self, client: CacheServerClient) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.detached: float | None = None
        self.attached: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and self.client.attached:
            time.sleep(0.001)
        self.detached = time.monotonic()
        while not self.stop.is_set() and not self.client.attached:
            time.sleep(0.001)
        if self.client.attached:
            self.attached = time.monotonic()


def server_restart(args: argparse.Namespace, shape: ModelShape, procs: Processes) -> Restart:
    """(c) The server is SIGKILLed under an engine serving a stream of requests, then restarted."""
    url = f"ipc://{procs.workdir}/restart.sock"
    n = args.stream_tokens
    request = PagedRequest(shape, n, args.block_size, seed=1)
    server = ServerProcess(procs, url, args.arena_gb, args.heartbeat)
    engine = build_engine(shape, url)
    client = engine.memory_allocator
    assert isinstance(client, CacheServerClient)
    watch = AttachmentWatch(client)
    errors = engine.stats.get("errors")
    timeline: list[dict[str, Any]] = []
    killed_at = t_first = time.monotonic()
    try:
        for i in range(args.stream_requests):
            if i == args.kill_after:
                killed_at = time.monotonic()
                watch.start()
                server.kill()
            if i == args.restart_after:
                server = ServerProcess(procs, url, args.arena_gb, args.heartbeat)
            phase = "before" if i < args.kill_after else "outage" if i < args.restart_after else "after"
            request.clear_target()
            t0 = time.monotonic()
            entry: dict[str, Any] = {"request": i, "start_s": round(t0 - t_first, 4), "phase": phase,
                                     "hit": False}
            timeline.append(entry)
            try:
                trip = store_and_retrieve(engine, request, new_tokens(n))
            except Exception as e:  # noqa: BLE001 -- what this part counts (goal: none)
                entry["raised"] = f"{type(e).__name__}: {e}"
                print(f"request {i} raised {entry['raised']}", file=sys.stderr)
                continue
            if trip.mask.any() and not request.exact(trip.mask):
                raise BenchmarkFailure(f"request {i}: the retrieved KV differs from the stored KV")
            entry.update(hit=bool(trip.mask.all()), ms=round((trip.store_s + trip.retrieve_s) * 1e3, 2))
            time.sleep(args.stream_interval)
        watch.join(10 * server.heartbeat + 10)
    finally:
        watch.stop.set()
        engine.close()
        server.stop()
    if watch.attached is None or watch.detached is None:
        raise BenchmarkFailure("the engine did not detach from the killed server and attach to the new one")

    def served(phase: str) -> str:
        done = [e for e in timeline if e["phase"] == phase]
        return f"{sum(e['hit'] for e in done)}/{len(done)}"

    attached_s = watch.attached - t_first
    missed = sum(1 for e in timeline if e["phase"] == "after" and not e["hit"] and e["start_s"] < attached_s)
    slowest = {phase: max((e.get("ms", 0.0) for e in timeline if e["phase"] == phase), default=0.0)
               for phase in ("before", "outage", "after")}
    to_attached = watch.attached - server.serving
    return Restart(args.stream_requests, sum("raised" in e for e in timeline),
                   int(engine.stats.get("errors") - errors), served("before"), served("outage"),
                   served("after"), missed, slowest, watch.detached - killed_at,
                   server.serving - server.started, to_attached, to_attached / server.heartbeat,
                   killed_at - t_first, timeline)


# ---- report -------------------------------------------------------------------------------------

def report(args: argparse.Namespace, shape: ModelShape, tp: Throughput, memory: list[MemoryRow],
           killed: Reaping, silent: Reaping, restart: Restart, removed: list[str]) -> None:
    mb = 1 << 20
    info = cpu_info()
    print(f"\nLMCache cache server vs in-process hot tier. CPU: {info['cpu']} ({info['cpus']} CPUs, amx_tile "
          f"{'in' if info['amx'] else 'not in'} its flags), {torch.get_num_threads()} torch threads")
    print(f"1. throughput: {tp.tokens} tokens of {shape.layers} layers x {shape.heads} KV heads x "
          f"{shape.head_size} {str(shape.dtype).removeprefix('torch.')} ({tp.request_bytes / 1e6:.1f} MB), "
          f"paged blocks of {args.block_size}, chunks of {shape.chunk}; medians of {tp.trials} interleaved "
          f"trials after {tp.warmup} warm-up")
    print(f"   {'':<24}{'store GB/s':>12}{'retrieve GB/s':>15}")
    print(f"   {'in-process hot tier':<24}{tp.local_store_gbps:>12.2f}{tp.local_retrieve_gbps:>15.2f}")
    print(f"   {'cache server':<24}{tp.server_store_gbps:>12.2f}{tp.server_retrieve_gbps:>15.2f}")
    ok = "met" if min(tp.store_ratio, tp.retrieve_ratio) >= GOAL else "NOT met"
    print(f"   {'server / in-process':<24}{tp.store_ratio:>12.2f}{tp.retrieve_ratio:>15.2f}"
          f"   (goal >= {GOAL}: {ok})")
    print(f"   {'server with KV events':<24}{tp.events_store_gbps:>12.2f}{tp.events_retrieve_gbps:>15.2f}")
    print(f"   {'with events / without':<24}{tp.events_store_ratio:>12.2f}{tp.events_retrieve_ratio:>15.2f}")
    print(f"2. server memory with idle engines (after 4 heartbeats of {args.heartbeat:g} s), MB:")
    print(f"   {'engines':>8}{'VmRSS':>9}{'RssAnon':>9}{'RssShmem':>10}{'arena resident':>16}"
          f"{'arena grown':>13}")
    for r in memory:
        print(f"   {r.engines:>8}{r.vm_rss / mb:>9.1f}{r.rss_anon / mb:>9.1f}{r.rss_shmem / mb:>10.1f}"
              f"{r.arena_resident / mb:>16.1f}{r.arena_grown / mb:>13.1f}")
    print(f"3. faults (heartbeat {args.heartbeat:g} s):")
    print(f"   a. engine SIGKILLed holding {killed.slots} slots ({killed.bytes_held / mb:.1f} MB): gone and "
          f"memory back after {killed.seconds * 1e3:.1f} ms = {killed.heartbeats:.2f} heartbeats (its "
          f"process took {(killed.exit_seconds or 0) * 1e3:.1f} ms to exit)")
    print(f"   b. unwatched engine (pid null) silent holding 1 slot: reaped after {silent.seconds:.2f} s = "
          f"{silent.heartbeats:.2f} heartbeats (expected about 2)")
    print(f"   c. {restart.requests} store+retrieve requests, server SIGKILLed before request "
          f"{args.kill_after}, restarted before {args.restart_after}: {restart.raised} raised, "
          f"{restart.engine_errors} engine errors (goal 0)")
    print(f"      served from cache: before the kill {restart.served_before_kill}, during the outage "
          f"{restart.served_during_outage}, after the restart {restart.served_after_restart} "
          f"({restart.missed_after_restart_before_attach} missed before the engine attached again)")
    slow = ", ".join(f"{phase} {ms:.1f} ms" for phase, ms in restart.slowest_request_ms.items())
    print(f"      slowest store+retrieve: {slow}")
    print(f"      engine detached {restart.detached_after_kill_s * 1e3:.0f} ms after the kill; new server: "
          f"start to serving {restart.server_start_to_serving_s:.2f} s, serving to engine attached again "
          f"{restart.serving_to_attached_s:.2f} s = {restart.serving_to_attached_heartbeats:.2f} heartbeats")
    print(f"cleanup: every subprocess ended; arenas of killed servers removed at the end: "
          f"{removed or 'none'}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=None, help="interleaved trials (default 15, --quick 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up trials of each")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per request (default 4096, --quick 1024)")
    parser.add_argument("--quick", action="store_true", help="small sizes for a fast check")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--arena-gb", type=float, default=None, help="each L1 arena (default 4, --quick 1)")
    parser.add_argument("--heartbeat", type=float, default=0.5, help="the servers' heartbeat, seconds")
    parser.add_argument("--engines", default=None, help="idle engine counts (default 0,1,2,4; --quick 0,1,2)")
    parser.add_argument("--fault-slots", type=int, default=4, help="slots the killed engine holds")
    parser.add_argument("--stream-requests", type=int, default=None, help="default 40 (--quick 12)")
    parser.add_argument("--kill-after", type=int, default=None, help="default 10 (--quick 3)")
    parser.add_argument("--restart-after", type=int, default=None, help="default 20 (--quick 6)")
    parser.add_argument("--stream-tokens", type=int, default=None, help="default 1024 (--quick 512)")
    parser.add_argument("--stream-interval", type=float, default=0.1, help="seconds between stream requests")
    args = parser.parse_args()
    defaults = {"trials": (15, 5), "tokens": (4096, 1024), "arena_gb": (4.0, 1.0),
                "engines": ("0,1,2,4", "0,1,2"), "stream_requests": (40, 12), "kill_after": (10, 3),
                "restart_after": (20, 6), "stream_tokens": (1024, 512)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.engines = sorted({int(x) for x in str(args.engines).split(",")})
    if min(args.trials, args.tokens, args.stream_tokens) < 1 or min(args.warmup, *args.engines) < 0:
        parser.error("--trials, --tokens, --stream-tokens must be > 0, --warmup and --engines >= 0")
    if not 0 < args.kill_after < args.restart_after < args.stream_requests:
        parser.error("need 0 < --kill-after < --restart-after < --stream-requests")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shape = ModelShape()
    with tempfile.TemporaryDirectory(prefix="lmcache-server-bench-") as workdir:
        procs = Processes(Path(workdir))
        removed: list[str] = []
        try:
            tp = measure_throughput(args, shape, procs)
            server = ServerProcess(procs, f"ipc://{workdir}/faults.sock", args.arena_gb, args.heartbeat)
            try:
                memory = measure_memory(args, shape, procs, server)
                killed = killed_engine(args, shape, procs, server)
                silent = silent_engine(shape, server)
            finally:
                server.stop()
            restart = server_restart(args, shape, procs)
        finally:
            removed = procs.close()
    left = procs.arenas()
    if left:
        raise BenchmarkFailure(f"shared arenas of this run still in {SHM_DIR}: {left}")
    report(args, shape, tp, memory, killed, silent, restart, removed)
    OUT.mkdir(exist_ok=True)
    path = OUT / f"server_throughput{'-quick' if args.quick else ''}.json"
    result = {**cpu_info(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
              "args": vars(args), "throughput": asdict(tp), "memory": [asdict(r) for r in memory],
              "killed_engine": asdict(killed), "silent_engine": asdict(silent),
              "server_restart": asdict(restart)}
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
