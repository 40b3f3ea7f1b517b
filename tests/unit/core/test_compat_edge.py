"""Compatibility code stays at the edge: `lmcache.compat` imports the core, the core never imports
it, and the vLLM v1 connector runs on the core alone.

Read from the source with `ast` (every module under lmcache/), plus one run-time check that
importing the core and the connector loads nothing of the edge (the registries import modules by
name, which `ast` cannot follow).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import lmcache

PACKAGE_DIR = Path(lmcache.__file__).parent
COMPAT = "lmcache.compat"

# seed paths whose whole body re-exports names from lmcache.compat
ALIAS_MODULES = frozenset({
    "lmcache.integration.vllm.vllm_adapter",
    "lmcache.experimental.storage_backend.local_disk_backend",
    "lmcache.storage_backend.serde.cachegen_basics",
    "lmcache.storage_backend.serde.cachegen_decoder",
    "lmcache.storage_backend.serde.cachegen_encoder",
})
# core functions that import lmcache.compat when called (never at import time): the public names
# `LMCacheEngineConfig.from_legacy` and `lmcache.config.LEGACY_BACKENDS` etc. (module __getattr__)
LAZY_ENTRY_POINTS = frozenset({
    ("lmcache.config", "LMCacheEngineConfig.from_legacy"),
    ("lmcache.config", "__getattr__"),
})
CONNECTOR_MODULES = ("lmcache.integration.vllm.connector", "lmcache.integration.vllm.worker",
                     "lmcache.integration.vllm.scheduler")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (or, for `from m import name`, m.name when that is a module)
    scope: str | None  # the enclosing function's qualified name; None at import time
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


MODULES = all_modules()


def is_edge(name: str) -> bool:
    return name == COMPAT or name.startswith(COMPAT + ".")


def in_edge(name: str) -> bool:
    """Modules of the compat edge: lmcache.compat, the seed-path aliases and lmcache.experimental."""
    return is_edge(name) or name in ALIAS_MODULES or name.split(".")[:2] == ["lmcache", "experimental"]


def imports_of(name: str, source: str | None = None) -> list[Import]:
    """Every import statement of module `name` (at any depth), with its enclosing function."""
    path = MODULES.get(name)
    tree = ast.parse(source if source is not None else path.read_text())  # type: ignore[union-attr]
    package = name if path is not None and path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [*scope, child.name], True)
            elif isinstance(child, ast.ClassDef):
                visit(child, [*scope, child.name], in_function)
            else:
                where = ".".join(scope) if in_function else None
                if isinstance(child, ast.Import):
                    found.extend(Import(name, alias.name, where, child.lineno) for alias in child.names)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join([*anchor, base] if base else anchor)
                    found.append(Import(name, base, where, child.lineno))
                    found.extend(Import(name, f"{base}.{alias.name}", where, child.lineno)
                                 for alias in child.names if f"{base}.{alias.name}" in MODULES)
                visit(child, scope, in_function)

    visit(tree, [], False)
    return found


def edge_import_violations(imports: list[Import]) -> list[str]:
    return [f"{i.module}:{i.line} imports {i.target}" + (f" (in {i.scope})" if i.scope else " at import time")
            for i in imports
            if is_edge(i.target) and not in_edge(i.module) and (i.module, i.scope) not in LAZY_ENTRY_POINTS]


def test_no_core_module_imports_the_compat_edge():
    imports = [i for name in MODULES for i in imports_of(name)]
    assert edge_import_violations(imports) == []


def test_the_check_catches_an_import_of_the_compat_edge_anywhere_in_a_core_module():
    for source in ("from lmcache.compat import legacy_config\n",
                   "import lmcache.compat.vllm_adapter as a\n",
                   "def f():\n    from lmcache.compat.disk_seed import LocalDiskBackend\n",
                   "class C:\n    def from_legacy(self):\n        from lmcache import compat\n",
                   "from ..compat import legacy_config\n"):
        assert edge_import_violations(imports_of("lmcache.storage_backend.storage_manager", source)), source
    lazy = ("class LMCacheEngineConfig:\n"
            "    def from_legacy():\n"
            "        from lmcache.compat import legacy_config\n")
    assert edge_import_violations(imports_of("lmcache.config", lazy)) == []


def test_each_lazy_entry_point_is_one_that_imports_the_edge():
    used = {(i.module, i.scope) for name in MODULES for i in imports_of(name) if is_edge(i.target)}
    assert LAZY_ENTRY_POINTS <= used


def test_alias_modules_only_re_export():
    for name in ALIAS_MODULES:
        body = ast.parse(MODULES[name].read_text()).body
        docstring, *rest = body
        assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), name
        for node in rest:
            is_all = isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]
            assert isinstance(node, ast.ImportFrom) or is_all, f"{name}:{node.lineno} is more than an alias"


def closure(roots: tuple[str, ...], imports: Callable[[str], list[Import]] = imports_of) -> dict[str, str]:
    """Every lmcache module the `roots` import, directly or not (at import time or inside a
    function, except through a lazy entry point), with the module that imports it."""
    seen: dict[str, str] = {root: root for root in roots}
    todo = list(roots)
    while todo:
        for i in imports(todo.pop()):
            if (i.module, i.scope) in LAZY_ENTRY_POINTS:
                continue
            parts = i.target.split(".")
            for n in range(2, len(parts) + 1):  # importing a.b.c runs a.b's __init__ too
                target = ".".join(parts[:n])
                if target in MODULES and target not in seen:
                    seen[target] = i.module
                    todo.append(target)
    return seen


def test_the_vllm_connector_imports_only_the_core():
    reached = closure(CONNECTOR_MODULES)
    assert {m: by for m, by in reached.items() if in_edge(m)} == {}
    assert "lmcache.integration.vllm.engine_setup" in reached  # how the worker builds its engine


def test_the_closure_catches_an_edge_module_imported_through_a_core_module():
    def with_alias(name: str) -> list[Import]:
        found = imports_of(name)
        if name == "lmcache.integration.vllm.transfer":
            found.append(Import(name, "lmcache.integration.vllm.vllm_adapter", None, 1))
        return found

    reached = closure(CONNECTOR_MODULES, with_alias)
    assert reached["lmcache.integration.vllm.vllm_adapter"] == "lmcache.integration.vllm.transfer"
    assert reached["lmcache.compat.vllm_adapter"] == "lmcache.integration.vllm.vllm_adapter"


def test_importing_the_core_and_the_connector_loads_nothing_of_the_edge():
    pytest.importorskip("vllm")
    script = "\n".join([
        "import sys",
        *(f"import {m}" for m in (*CONNECTOR_MODULES, "lmcache.cache_engine", "lmcache.storage_backend")),
        "from lmcache.storage_backend.registry import tier_classes",
        "from lmcache.storage_backend.serde import serde_names",
        "from lmcache.config import LMCacheEngineConfig",
        "tier_classes(), serde_names(), LMCacheEngineConfig.from_defaults()",
        "print(' '.join(m for m in sys.modules if m.startswith('lmcache.')))",
    ])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=PACKAGE_DIR.parent).stdout.split()
    assert "lmcache.integration.vllm.worker" in out
    assert [m for m in out if in_edge(m)] == []


def test_the_seed_path_lmcache_utils_is_the_cache_key_module():
    from lmcache import cache_key, utils

    assert (utils.CacheEngineKey, utils.dtype_tag) == (cache_key.CacheEngineKey, cache_key.dtype_tag)
