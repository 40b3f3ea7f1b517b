"""Native CPU kernels, compiled on first use.

Each library is one C source file here (`copy_kernels.c`: the connectors' token copies;
`cachegen_kernels.c`: CacheGen's quantizer passes and rANS coder). `load(name)` builds it with the
system C compiler into a per-user cache (``$LMCACHE_NATIVE_CACHE_DIR`` or
``~/.cache/lmcache/native``, one file per source digest and flags) and loads it with ctypes (which
releases the GIL during each call). Where no compiler exists, or ``LMCACHE_NATIVE=0``, `load`
returns None and callers use their pure-Python path, which gives the same results more slowly.
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


def _copy_signatures(lib: ctypes.CDLL) -> None:
    lib.lmc_paged_copy.restype = _INT
    lib.lmc_paged_copy.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _INT, _INT]
    lib.lmc_packed_copy.restype = _INT
    lib.lmc_packed_copy.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _INT, _PTR, _I64, _PTR, _PTR,
                                    _PTR, _I64, _INT, _INT]


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


_SPECS = {
    "copy_kernels": _Spec("copy_kernels.c", ("-O3", "-fPIC", "-shared", "-fopenmp"), _copy_signatures),
    # no contraction into fused multiply-adds: results must equal the numpy reference bit for bit;
    # no FP traps assumed (lets float selects vectorize; values are unchanged)
    "cachegen_kernels": _Spec("cachegen_kernels.c",
                              ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off",
                               "-fno-trapping-math"),
                              _cachegen_signatures),
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


def load(name: str = "copy_kernels") -> ctypes.CDLL | None:
    """The compiled library `name` (default: the copy kernels), or None when native kernels are
    unavailable or disabled. Built once per process (and cached on disk across processes)."""
    spec = _SPECS[name]
    with _lock:
        if name in _loaded:
            return _loaded[name]
        _loaded[name] = None
        if disabled():
            return None
        source = Path(__file__).with_name(spec.source)
        digest = hashlib.sha256(source.read_bytes() + " ".join(spec.cflags).encode()).hexdigest()[:16]
        target = _cache_dir() / f"{name}-{digest}-{platform.machine()}.so"
        try:
            if not target.exists():
                _build(source, spec.cflags, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            logger.warning("native %s unavailable, using the Python path: %s %s", name, e,
                           detail.decode(errors="replace")[:500])
            return None
        spec.declare(lib)
        _loaded[name] = lib
        return lib
