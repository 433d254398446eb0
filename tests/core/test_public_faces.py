"""Packages meet through public faces: no module in kvfsm/, benchmarks/ or examples/ imports
another package's private module or name, or reads a private attribute its own package does not
define. A package is kvfsm's first level (kvfsm.core, kvfsm.cli, ...); within one, private
names are shared freely. Renaming a private field then never changes another package silently.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import kvfsm

_REPO = Path(kvfsm.__file__).resolve().parents[1]
_SCANNED = ("kvfsm", "benchmarks", "examples")
# Private attributes of other libraries read on purpose, each with why there is no public way.
_ALLOWED = {
    # NamedTuple's documented API is underscored so as not to clash with field names.
    "_replace": "NamedTuple",
    "_asdict": "NamedTuple",
    "_fields": "NamedTuple",
    # vLLM's Request exposes its token list only as a read-only view; P's prompt back-off
    # (kvfsm/vllm/_scheduler.py) must shorten the list itself.
    "_all_token_ids": "vllm.v1.request.Request",
}


def _package(path: Path) -> str:
    """kvfsm.X for a module under kvfsm/X, else the top folder (each script its own)."""
    rel = path.relative_to(_REPO).parts
    if rel[0] == "kvfsm":
        return "kvfsm." + rel[1].removesuffix(".py") if len(rel) > 2 else "kvfsm"
    return "/".join(rel)


def _package_of_module(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "kvfsm" else parts[0]


def _files() -> list[Path]:
    return sorted(p for top in _SCANNED for p in (_REPO / top).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(tree: ast.AST) -> Iterator[str]:
    """Private names a module defines: functions, classes, attributes and variables it binds."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            yield node.attr  # an attribute of its own; a store into another object's is a reach
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id
        elif isinstance(node, ast.arg):
            yield node.arg


def _own_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for path in _files():
        found = {n for n in _defined_private_names(ast.parse(path.read_text())) if _private(n)}
        names.setdefault(_package(path), set()).update(found)
    return names


def _violations(where: str, package: str, source: str, own: set[str]) -> Iterator[str]:
    """Each reach into another package's private names in `source`, a module of `package`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvfsm"):
            if _package_of_module(node.module) == package:
                continue
            if any(_private(part) for part in node.module.split(".")):
                yield f"{where}:{node.lineno} imports {node.module}"
            yield from (
                f"{where}:{node.lineno} imports {node.module}.{alias.name}"
                for alias in node.names
                if _private(alias.name)
            )
        elif isinstance(node, ast.Import):
            yield from (
                f"{where}:{node.lineno} imports {alias.name}"
                for alias in node.names
                if alias.name.startswith("kvfsm")
                and _package_of_module(alias.name) != package
                and any(_private(part) for part in alias.name.split("."))
            )
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in own and node.attr not in _ALLOWED:
                yield f"{where}:{node.lineno} reads {ast.unparse(node)}"
        elif isinstance(node, ast.Call) and _reads_by_name(node) and _name_read(node) not in own:
            yield f"{where}:{node.lineno} reads {ast.unparse(node)}"


def _name_read(call: ast.Call) -> object:
    return cast(ast.Constant, call.args[1]).value


def _reads_by_name(node: ast.AST) -> bool:
    """`getattr(x, "_name")`: a private attribute read by its name as a string."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
        and _private(node.args[1].value)
    )


def test_no_module_reaches_into_another_package() -> None:
    names = _own_names()
    found = [
        violation
        for path in _files()
        for violation in _violations(
            str(path.relative_to(_REPO)), _package(path), path.read_text(), names[_package(path)]
        )
    ]
    assert not found, "private names read across packages:\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_reach() -> None:
    """Not vacuous: a private module import, a private name, a foreign private attribute and
    one read by name."""
    probe = (
        "from kvfsm.core._side import Side\n"
        "from kvfsm.runtime import _seals\n"
        "def f(engine):\n    return engine._never_defined_anywhere\n"
        "def g(engine):\n    return getattr(engine, '_nor_this')\n"
    )
    found = list(_violations("probe.py", "kvfsm.cli", probe, _own_names()["kvfsm.cli"]))
    assert len(found) == 4, found
