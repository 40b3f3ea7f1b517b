"""`make demo`'s dtype: bf16 only where the CPU computes it in hardware, unless --dtype says."""

import pytest
import torch

from benchmarks.machine import pick_dtype
from lmcache.integration.vllm.cpu_build import native_build


@pytest.mark.parametrize(("amx", "avx512_bf16", "dtype"), [
    (True, True, "bfloat16"),
    (False, True, "bfloat16"),
    (True, False, "bfloat16"),
    (False, False, "float32"),
])
def test_auto_picks_bf16_only_with_amx_or_avx512_bf16(monkeypatch, amx, avx512_bf16, dtype):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert pick_dtype("auto").dtype == dtype


def test_float32_says_bf16_would_be_emulated(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert pick_dtype().reason == "this CPU has no avx512_bf16/AMX, so bf16 would be emulated"


@pytest.mark.parametrize("requested", ["bfloat16", "float32"])
def test_dtype_flag_overrides_the_cpu(monkeypatch, requested):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: requested == "float32")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: requested == "float32")
    assert pick_dtype(requested) == (requested, "set by --dtype")


def test_bf16_is_picked_here_exactly_where_vllm_loads_its_bf16_build():
    assert (pick_dtype().dtype == "bfloat16") == (native_build().name == "avx512_bf16")
