"""Faults planted in a real engine, for tests of LMCache's self-verification (`verify_rate`).

`wrong_layout_env(layer, trigger=None)`: the environment for a new engine process (vLLM and its
workers) in which LMCache's worker stores layer `layer` of every chunk in a wrong layout (with a
`trigger` path: only while that file exists, so one engine can run clean first): after each store copy
(`BatchedKVConnector.batched_from_gpu`, the engine's connector gathering vLLM's cache into chunk
objects) K and V of that layer are replaced by the transpose of their ``[tokens, hidden]`` rows
read back as ``[tokens, hidden]`` (the bytes of a token-major layer written dim-major). Loads are
untouched, so the engine's own hits still round-trip what it stored; only a check that reads
vLLM's cache independently of that copy (an audit) sees the difference.

How: a ``sitecustomize.py`` written (once, under the temporary folder) by this module, put first on
``PYTHONPATH``; it imports nothing at start-up: it patches the class when Python imports
`lmcache.gpu_connector.batched`, then runs the next ``sitecustomize.py`` on the path (so it
composes with `lmcache.integration.vllm.cpu_build.forced_build_env`'s kernel-build override: call
this inside that environment). Self-contained (standard library only), so that it may be copied as
it is; no hook of it exists in LMCache's production code.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

LAYER_ENV = "LMCACHE_PLANTED_WRONG_LAYOUT_LAYER"
TRIGGER_ENV = "LMCACHE_PLANTED_WRONG_LAYOUT_TRIGGER"

_HOOK = '''\
"""Planted fault (tests/helpers/planted_faults.py): LMCache's store copy writes one layer in a
wrong layout. Installed when lmcache.gpu_connector.batched is imported."""
import importlib.abc
import importlib.util
import os
import runpy
import sys

_LAYER = int(os.environ["LMCACHE_PLANTED_WRONG_LAYOUT_LAYER"])
_TRIGGER = os.environ.get("LMCACHE_PLANTED_WRONG_LAYOUT_TRIGGER", "")
_TARGET = "lmcache.gpu_connector.batched"


def _scramble(objs):
    if _TRIGGER and not os.path.exists(_TRIGGER):
        return
    for obj in objs:
        blob = obj.tensor  # [kv_count, layers, tokens, hidden]
        for rows in blob[:, _LAYER]:
            rows.copy_(rows.t().contiguous().view(rows.shape))


def _patch(module):
    cls = module.BatchedKVConnector
    original = cls.batched_from_gpu

    def batched_from_gpu(self, memory_objs, starts, ends, *, on_done=None, **kwargs):
        if on_done is None:
            original(self, memory_objs, starts, ends, on_done=None, **kwargs)
            _scramble(memory_objs)
            return

        def done(error):
            if error is None:
                _scramble(memory_objs)
            on_done(error)

        original(self, memory_objs, starts, ends, on_done=done, **kwargs)

    cls.batched_from_gpu = batched_from_gpu


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _next = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.abspath(_entry or ".") != _here and os.path.isfile(_next):
        runpy.run_path(_next, run_name="sitecustomize")
        break
'''


def _hook_dir() -> Path:
    """The folder holding the hook's ``sitecustomize.py`` (written once per content)."""
    digest = hashlib.sha256(_HOOK.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"lmcache-planted-wrong-layout-{digest}"
    path = folder / "sitecustomize.py"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".sitecustomize-{os.getpid()}.tmp"
        tmp.write_text(_HOOK)
        os.replace(tmp, path)
    return folder


def wrong_layout_env(layer: int, trigger: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Variables to add to a new engine process's environment so that LMCache's worker stores
    layer `layer` (an index into the chunk's layers) in a wrong layout (see the module docstring),
    always, or only while the file `trigger` exists. The current ``PYTHONPATH`` is kept after the
    hook's folder."""
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    path = os.pathsep.join(p for p in (str(_hook_dir()), os.environ.get("PYTHONPATH", "")) if p)
    env = {LAYER_ENV: str(layer), "PYTHONPATH": path}
    if trigger is not None:
        env[TRIGGER_ENV] = os.fspath(trigger)
    return env
