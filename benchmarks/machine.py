"""What machine a benchmark ran on: the CPU's model name, whether it has AMX, the cores; and the
dtype it computes natively."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import NamedTuple


class DtypeChoice(NamedTuple):
    dtype: str  # "bfloat16" or "float32"
    reason: str  # why, for one line of output


def cpu_info() -> dict[str, object]:
    """``{"cpu": model name, "amx": bool, "cpus": logical CPUs, "arch": machine}`` (from
    /proc/cpuinfo where it exists)."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
            if model and flags:
                break
    return {"cpu": model, "amx": "amx_tile" in flags, "cpus": os.cpu_count(), "arch": platform.machine()}


def cpu_line() -> str:
    info = cpu_info()
    return f"{info['cpu']} ({'with' if info['amx'] else 'no'} AMX, {info['cpus']} CPUs)"


def pick_dtype(requested: str = "auto") -> DtypeChoice:
    """`requested` ("auto", "bfloat16" or "float32") as the dtype to run and why. "auto" is
    bfloat16 where the CPU computes it in hardware (AMX or avx512_bf16, the torch probes vLLM-CPU
    asks), float32 otherwise: there vLLM-CPU and oneDNN emulate bf16, 2-3 times slower than fp32."""
    if requested != "auto":
        return DtypeChoice(requested, "set by --dtype")
    import torch

    if torch.cpu._is_amx_tile_supported():
        return DtypeChoice("bfloat16", "this CPU has AMX")
    if torch.cpu._is_avx512_bf16_supported():
        return DtypeChoice("bfloat16", "this CPU has avx512_bf16")
    return DtypeChoice("float32", "this CPU has no avx512_bf16/AMX, so bf16 would be emulated")
