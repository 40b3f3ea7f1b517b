"""Native CPU kernels, compiled on first use.

Each library is one C source file here (`copy_kernels.c`: the connectors' token copies;
`cachegen_kernels.c`: CacheGen's quantizer passes and rANS coder). `load(name)` builds it with the
system C compiler into a per-user cache (``$LMCACHE_NATIVE_CACHE_DIR`` or
``~/.cache/lmcache/native``, one file per source digest and flags) and loads it with ctypes (which
releases the GIL during each call). Where no compiler exists, or ``LMCACHE_NATIVE=0``, `load`
returns None and callers use their pure-Python path, which gives the same results more slowly.

Vector paths (x86, `COPY_ISAS`): the copies pick theirs at each call, the widest the CPU has
(`copy_isa`); CacheGen's kernels are built once per path (baseline x86-64 for "sse2", x86-64-v3 for
"avx2", x86-64-v4 with 512-bit vectors for "avx512") and loaded in the widest build not above it.
``LMCACHE_COPY_ISA=sse2|avx2|avx512`` caps both, so every path can be tested on one machine; all
paths give the same bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

COPY_ISA_ENV = "LMCACHE_COPY_ISA"
COPY_ISAS = ("sse2", "avx2", "avx512")
"""The vector paths (x86), narrowest first; ``LMCACHE_COPY_ISA`` caps the kernels at one."""


def _copy_signatures(lib: ctypes.CDLL) -> None:
    lib.lmc_paged_copy.restype = _INT
    lib.lmc_paged_copy.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _INT, _INT]
    lib.lmc_packed_copy.restype = _INT
    lib.lmc_packed_copy.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _INT, _PTR, _I64, _PTR, _PTR,
                                    _PTR, _I64, _INT, _INT]
    for name in ("lmc_copy_isa", "lmc_cpu_isa"):
        getattr(lib, name).restype = _INT
        getattr(lib, name).argtypes = []


def _cachegen_signatures(lib: ctypes.CDLL) -> None:
    dims = [_I64, _I64, _I64]
    signatures = {
        "cg_stats": [_PTR, _INT, *dims, _PTR, _PTR, _INT],
        "cg_quantize": [_PTR, _INT, *dims, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR,
                        _INT],
        "cg_histogram": [_PTR, *dims, _PTR, _PTR, _PTR, _INT],
        "cg_group_ranges": [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR],
        "cg_layout": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR],
        "cg_normalize": [_PTR, _I64, _PTR, _PTR, _PTR],
        "cg_encode": [_PTR, *dims, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR,
                      _PTR, _INT],
        "cg_decode": [_PTR, _PTR, _PTR, *dims, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR,
                      _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _INT],
        "cg_encode_chunk": [_PTR, _INT, *dims, _I64, *[_PTR] * 17, _INT],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = _I64 if name in ("cg_encode", "cg_encode_chunk") else _INT  # word counts
        fn.argtypes = argtypes


@dataclass(frozen=True)
class _Spec:
    source: str
    cflags: tuple[str, ...]
    declare: Callable[[ctypes.CDLL], None]
    builds: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(path, extra cflags) of each build of the whole file, narrowest first; none: one build,
    whose code picks its vector path itself at run time."""


_SPECS = {
    "copy_kernels": _Spec("copy_kernels.c", ("-O3", "-fPIC", "-shared", "-fopenmp"), _copy_signatures),
    # no contraction into fused multiply-adds: results must equal the numpy reference bit for bit;
    # no FP traps assumed (lets float selects vectorize; values are unchanged)
    "cachegen_kernels": _Spec("cachegen_kernels.c",
                              ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off",
                               "-fno-trapping-math"),
                              _cachegen_signatures,
                              (("sse2", ()), ("avx2", ("-march=x86-64-v3",)),
                               ("avx512", ("-march=x86-64-v4", "-mprefer-vector-width=512")))),
}
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    env = os.environ.get("LMCACHE_NATIVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lmcache" / "native"


def _build(source: Path, cflags: tuple[str, ...], target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([cc, *cflags, str(source), "-o", str(out)], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: concurrent builders never see a torn file


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_malloc_tuned = False


def tune_malloc() -> bool:
    """Set glibc's heap to the state its own adaptive thresholds reach once a process has freed a
    32 MB block (allocations below 32 MB come from the heap, which keeps up to 64 MB free instead
    of returning it to the kernel at once). Without it a process that encodes CacheGen chunks
    returns the ~2 MB each encode frees and faults it back in on the next (~600 page faults,
    2 ms of kernel time per SmolLM2 chunk here); long-running servers that freed large tensors
    are already there. Once per process; not on other C libraries, or with
    ``LMCACHE_MALLOC_TUNING=0``. Returns True if the thresholds were set."""
    global _malloc_tuned
    with _lock:
        if _malloc_tuned:
            return True
        if os.environ.get("LMCACHE_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "no", "off"):
            return False
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not glibc
            return False
        mallopt.argtypes, mallopt.restype = [_INT, _INT], _INT
        _malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and \
            bool(mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD))
        return _malloc_tuned


def disabled() -> bool:
    """True when ``LMCACHE_NATIVE`` turns native kernels off."""
    return os.environ.get("LMCACHE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def load(name: str = "copy_kernels", isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled library `name` (default: the copy kernels), or None when native kernels are
    unavailable or disabled. Built once per process (and cached on disk across processes). A
    library built per vector path is loaded in the widest build this CPU runs that is not wider
    than `isa` (default: `copy_isa()`), or the baseline build where that one cannot be built;
    `build_of` says which."""
    spec = _SPECS[name]
    if not spec.builds:
        return _load(name, spec, spec.cflags)
    path, extra = _pick_build(spec.builds, isa or copy_isa())
    lib = _load(f"{name}-{path}", spec, spec.cflags + extra)
    if lib is None and extra and not disabled():  # e.g. a compiler that does not know the -march
        path = spec.builds[0][0]
        lib = _load(f"{name}-{path}", spec, spec.cflags)
    if lib is not None:
        _build_paths[id(lib)] = path
    return lib


def build_of(lib: ctypes.CDLL) -> str | None:
    """The vector path `lib` was built for (None: one build for every path)."""
    return _build_paths.get(id(lib))


_build_paths: dict[int, str] = {}
_isa_warned: set[str] = set()


def _load(key: str, spec: _Spec, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    with _lock:
        if key in _loaded:
            return _loaded[key]
        _loaded[key] = None
        if disabled():
            return None
        source = Path(__file__).with_name(spec.source)
        digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
        target = _cache_dir() / f"{key}-{digest}-{platform.machine()}.so"
        try:
            if not target.exists():
                _build(source, flags, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            logger.warning("native %s unavailable, using the Python path: %s %s", key, e,
                           detail.decode(errors="replace")[:500])
            return None
        spec.declare(lib)
        _loaded[key] = lib
        if key == "copy_kernels":
            logger.info("native copies: the %s path", _copy_isa(lib))
        return lib


def _pick_build(builds: tuple[tuple[str, tuple[str, ...]], ...], isa: str | None
                ) -> tuple[str, tuple[str, ...]]:
    """The widest of `builds` that this CPU runs and that is not wider than `isa` (the first,
    the baseline, where the CPU has none of their paths or `isa` names none)."""
    runs, wanted = copy_isas(), COPY_ISAS.index(isa) if isa in COPY_ISAS else -1
    fit = [b for b in builds if b[0] in runs and COPY_ISAS.index(b[0]) <= wanted]
    return fit[-1] if fit else builds[0]


def copy_isas() -> tuple[str, ...]:
    """The paths of `COPY_ISAS` this CPU can run (empty without the native copy kernels, or off x86)."""
    lib = load()
    return COPY_ISAS[: lib.lmc_cpu_isa() + 1] if lib is not None else ()


def copy_isa() -> str | None:
    """The path the native copies take now: the widest this CPU has, capped by ``LMCACHE_COPY_ISA``
    ("scalar" off x86, None without the native kernels). A cap the CPU cannot run, or a value that
    names no path, is logged once as a warning (the copies then take the widest path there is)."""
    lib = load()
    return _copy_isa(lib) if lib is not None else None


def _copy_isa(lib: ctypes.CDLL) -> str:
    level, cap = lib.lmc_copy_isa(), os.environ.get(COPY_ISA_ENV)
    if cap and cap not in _isa_warned and COPY_ISAS[level:level + 1] != (cap,):
        _isa_warned.add(cap)
        if cap not in COPY_ISAS:
            logger.warning("%s=%s names no copy path (one of %s); ignored", COPY_ISA_ENV, cap,
                           ", ".join(COPY_ISAS))
        elif COPY_ISAS.index(cap) > level:
            logger.warning("%s=%s: this CPU has no %s; the copies use %s", COPY_ISA_ENV, cap, cap,
                           COPY_ISAS[level] if level >= 0 else "scalar code")
    return COPY_ISAS[level] if level >= 0 else "scalar"
