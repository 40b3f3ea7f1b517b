"""Native CPU copy kernels, compiled on first use.

`copy_kernels.c` is built with the system C compiler into a per-user cache
(``$LMCACHE_NATIVE_CACHE_DIR`` or ``~/.cache/lmcache/native``) and loaded with ctypes (which
releases the GIL during the call). Where no compiler exists, or ``LMCACHE_NATIVE=0``, `load()`
returns None and callers use their pure-torch path, which is correct but ~2x slower on CPU.
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
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("copy_kernels.c")
_CFLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    env = os.environ.get("LMCACHE_NATIVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lmcache" / "native"


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([cc, *_CFLAGS, str(_SOURCE), "-o", str(out)], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: concurrent builders never see a torn file


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when native kernels are unavailable or disabled."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("LMCACHE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
            return None
        digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()[:16]
        target = _cache_dir() / f"copy_kernels-{digest}-{platform.machine()}.so"
        try:
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            logger.warning("native copy kernels unavailable, using torch copies: %s %s", e,
                           detail.decode(errors="replace")[:500])
            return None
        i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.lmc_paged_copy.restype = cint
        lib.lmc_paged_copy.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, cint, cint]
        lib.lmc_vec_packed_copy.restype = cint
        lib.lmc_vec_packed_copy.argtypes = [ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, cint, cint]
        _lib = lib
        return _lib
