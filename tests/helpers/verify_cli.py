"""`lmcache verify --json` run as the CLI against a test's OpenAI server."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

# what a server needs for verify to check its connector: /reset_prefix_cache and /server_info
# (vLLM's dev mode), hit tokens in the usage
VERIFY_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
VERIFY_ARGS = ("--enable-prompt-tokens-details",)


@dataclass
class VerifyRun:
    status: int
    report: dict[str, Any]
    stderr: str


def run_verify(base_url: str, *args: str) -> VerifyRun:
    done = subprocess.run([sys.executable, "-m", "lmcache.cli", "verify", "--url", base_url, "--json", *args],
                          capture_output=True, text=True, timeout=600)
    assert done.stdout, done.stderr
    return VerifyRun(done.returncode, json.loads(done.stdout), done.stderr)
