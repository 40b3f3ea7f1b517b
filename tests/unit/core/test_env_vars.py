"""The table of environment variables (`config.ENV_VARS`) against the code that reads them and the
README that documents them."""

from __future__ import annotations

import ast
import logging
import os
import re
from pathlib import Path

import pytest

from lmcache.config import ENV_PREFIX, ENV_VARS, _env_values, _field_types

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "lmcache"
FIELD_PATTERN = "LMCACHE_<FIELD>"


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and \
        isinstance(node.value, ast.Name) and node.value.id == "os"


def _named_reads(tree: ast.AST) -> list[ast.expr]:
    """The name expressions of `os.environ.get(X)`, `os.getenv(X)`, `os.environ[X]` and
    `X in os.environ` (not writes such as `os.environ.setdefault`)."""
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr == "get" and _is_environ(f.value)) or \
                    (f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                out.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            out.append(node.slice)
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn) \
                and _is_environ(node.comparators[0]):
            out.append(node.left)
    return out


def _string_constants(trees: dict[Path, ast.Module]) -> dict[str, str]:
    """Module-level `NAME = "text"` assignments of the package (names that readers use)."""
    out: dict[str, str] = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = node.value.value
    return out


def _resolve(expr: ast.expr, constants: dict[str, str]) -> str | None:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.Name):
        return constants.get(expr.id)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left, right = _resolve(expr.left, constants), _resolve(expr.right, constants)
        return left + right if left is not None and right is not None else None
    return None


def variables_read() -> dict[str, list[str]]:
    """Every environment variable the package reads by name -> where (``file:line``), from its
    Python sources (resolving module-level string constants) and its C sources (`getenv`)."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}
    constants = _string_constants(trees)
    found: dict[str, list[str]] = {}
    for path, tree in trees.items():
        for expr in _named_reads(tree):
            where = f"{path.relative_to(ROOT)}:{expr.lineno}"
            name = _resolve(expr, constants)
            assert name is not None, f"{where} reads an environment variable whose name is not a constant"
            found.setdefault(name, []).append(where)
    for path in PACKAGE.rglob("*.c"):
        for match in re.finditer(r'getenv\("([^"]+)"\)', path.read_text()):
            found.setdefault(match.group(1), []).append(str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_code_reads_is_in_the_table_and_every_entry_is_read():
    read = variables_read()
    fields = {ENV_PREFIX + name.upper() for name in _field_types()}
    table = {v.name: v for v in ENV_VARS}
    assert len(table) == len(ENV_VARS), "a name twice in ENV_VARS"
    missing = {name: where for name, where in read.items() if name not in table and name not in fields}
    assert not missing, f"read but not in config.ENV_VARS: {missing}"
    unread = [v.name for v in ENV_VARS if v.read and v.name not in read]
    assert not unread, f"in config.ENV_VARS but read nowhere: {unread}"
    said_unread = {v.name: read[v.name] for v in ENV_VARS if not v.read and v.name in read}
    assert not said_unread, f"marked read=False but read: {said_unread}"
    assert not fields & set(table), "a config field's variable is in ENV_VARS"


def test_the_readme_documents_exactly_the_table():
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.+?) \| (.+?) \|$", section, re.MULTILINE)
    assert {name: (default, doc) for name, default, doc in rows if name != FIELD_PATTERN} == \
        {v.name: (v.default, v.doc) for v in ENV_VARS}
    assert FIELD_PATTERN in [name for name, _, _ in rows]


@pytest.fixture
def lmcache_env(monkeypatch):
    """No ``LMCACHE_*`` variable set but those the test sets (`monkeypatch.setenv`)."""
    for var in [v for v in os.environ if v.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(var)
    return monkeypatch


def unknown_warnings(caplog) -> list[str]:
    with caplog.at_level(logging.WARNING, logger="lmcache.config"):
        _env_values()
    return [r.message for r in caplog.records if "unknown environment variable" in r.message]


def test_table_variables_are_not_warned_about_and_others_are(lmcache_env, caplog):
    for v in ENV_VARS:
        if v.name.startswith(ENV_PREFIX):
            lmcache_env.setenv(v.name, "1")
    lmcache_env.setenv("LMCACHE_NO_SUCH_THING", "1")
    assert unknown_warnings(caplog) == [
        "ignoring unknown environment variable LMCACHE_NO_SUCH_THING (no config field 'no_such_thing')"]
