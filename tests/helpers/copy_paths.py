"""The native kernels' vector paths as test parameters: every path of `native.COPY_ISAS`, those this
CPU cannot run skipped with that reason, and a context that forces one (``LMCACHE_COPY_ISA``)."""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lmcache import native

NATIVE_PATHS = [
    pytest.param(isa, id=isa, marks=pytest.mark.skipif(
        isa not in native.copy_isas(),
        reason=f"this CPU cannot run the {isa} path (it runs: {', '.join(native.copy_isas()) or 'none'})"))
    for isa in native.COPY_ISAS]


@contextmanager
def copy_isa(cap: str | None) -> Iterator[None]:
    """The native copies capped at `cap` (None: the widest this CPU has)."""
    old = os.environ.pop(native.COPY_ISA_ENV, None)
    if cap is not None:
        os.environ[native.COPY_ISA_ENV] = cap
    try:
        yield
    finally:
        os.environ.pop(native.COPY_ISA_ENV, None)
        if old is not None:
            os.environ[native.COPY_ISA_ENV] = old
