"""What machine a benchmark ran on: the CPU's model name, whether it has AMX, the cores."""

from __future__ import annotations

import os
import platform
from pathlib import Path


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
