"""Two lanes for ``pytest -n 2`` (pytest-xdist; `make test` runs so).

A vLLM engine's start is mostly its processes importing vLLM one after another, a core at a time,
so a second lane uses what one lane leaves idle (where a module already starts several engines at
once there is little to gain: `benchmarks/RESULTS.md`, "Test-suite time, third pass"). The modules
in ``tests/integration/vllm_multi`` start several engines or OpenAI servers each (a pair per model
family, fleets, a restart) and make one lane, about half the suite's time on 2 cores; every other
test makes the other. Each lane runs its tests one at a time in the usual order, so no two of those
modules run beside each other. Without ``-n`` the suite runs as one lane."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

MULTI_ENGINE_DIR = "tests/integration/vllm_multi/"


def lane(nodeid: str) -> str:
    return "multi-engine" if nodeid.startswith(MULTI_ENGINE_DIR) else "default"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        """xdist's scheduling by scope, with a lane as the scope: a worker per lane."""

        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return LaneScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def engines_stopped_at_the_end() -> Iterator[None]:
    """The vLLM engines stopped in the background (`stop_llm(..., wait=False)`) are gone before
    the session ends."""
    yield
    from tests.helpers.vllm_engines import wait_for_stops

    wait_for_stops()


@pytest.fixture(scope="session", autouse=True)
def cli_processes_stopped_at_the_end() -> Iterator[None]:
    """The `lmcache` servers a failed test left running (before its clean-up) do not outlive the
    session, nor keep their shared memory."""
    yield
    from tests.helpers.servers import stop_leftovers

    stop_leftovers()


@pytest.fixture(scope="session", autouse=True)
def vllm_sockets_in_a_folder_of_the_session() -> Iterator[None]:
    """vLLM's engines make their ZMQ ipc sockets in ``VLLM_RPC_BASE_PATH`` (the temporary folder
    by default) and leave them there, even when stopped cleanly (7 per OpenAI server): here they go
    to a folder of this session's own, removed at its end."""
    folder = tempfile.mkdtemp(prefix="lmcache-tests-vllm-")
    before = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = folder
    yield
    if before is None:
        del os.environ["VLLM_RPC_BASE_PATH"]
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = before
    shutil.rmtree(folder, ignore_errors=True)
