"""`make demo`'s script end to end on a short document: it serves round 2 from LMCache, names what
it ran on, and its exit status agrees with the goals it reports (once a refactor broke its stats
call, and nothing but a `make demo` by hand would have noticed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from lmcache.integration.vllm.cpu_build import native_build
from tests.helpers.servers import REPO

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_the_demo_serves_its_repeat_from_lmcache_and_exits_by_its_goals(tmp_path):
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "long_doc_qa.py"), "--configs", "lmcache",
         "--num-docs", "1", "--doc-tokens", "600", "--kv-gb", "0.25", "--out", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True, text=True, timeout=600)
    out = tmp_path / "long_doc_qa.json"
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    (result,) = report["results"]
    (prompt,) = report["prompt_tokens"]
    assert result["name"] == "lmcache" and prompt > 600 and len(result["first_tokens"]) == 1
    # round 2: every prompt token but the last served from LMCache's CPU tier (vLLM's cache was reset)
    assert report["summary"]["lmcache_round2_cached_tokens"] == [prompt - 1]
    assert result["kernels"] == native_build().library and result["attn_isa"] in ("vec", "vec16", "amx")
    goals = report["summary"]["goals"]
    assert goals and proc.returncode == (0 if all(g["met"] for g in goals) else 1), proc.stderr[-2000:]
