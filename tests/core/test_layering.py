"""The core is sans-I/O: no threads, sockets, NIXL, ZMQ, vLLM, sleeps or wall clock in
kvfsm.core, kvfsm.lifecycle, kvfsm.layout or kvfsm.wire. import-linter checks the package layers in
CI; this test also catches `time`, `os` and clock calls hidden behind aliases."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvfsm

_ROOT = Path(kvfsm.__file__).parent
_PURE = ("core", "lifecycle", "layout", "wire")
_FORBIDDEN_MODULES = {
    "asyncio",
    "nixl",
    "nixl_cu12",
    "nixl_cu13",
    "select",
    "signal",
    "socket",
    "subprocess",
    "threading",
    "time",
    "torch",
    "vllm",
    "zmq",
    "kvfsm.fabric",
    "kvfsm.runtime",
    "kvfsm.testing",
    "kvfsm.cli",
    "kvfsm.harness",
    "kvfsm.vllm",
    "kvfsm.sidechannel",
}
# `lifecycle` reads its model files at load time; nothing else touches the file system.
_FILE_ACCESS_ALLOWED = {"lifecycle"}


def _modules() -> list[Path]:
    return sorted(p for pkg in _PURE for p in (_ROOT / pkg).glob("*.py"))


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_pure_layers_import_no_io(path: Path) -> None:
    imported = _imports(ast.parse(path.read_text()))
    bad = {
        name
        for name in imported
        for forbidden in _FORBIDDEN_MODULES
        if name == forbidden or name.startswith(forbidden + ".")
    }
    assert not bad, f"{path} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_pure_layers_do_no_io_calls(path: Path) -> None:
    tree = ast.parse(path.read_text())
    calls = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert "open" not in calls or path.parent.name in _FILE_ACCESS_ALLOWED
    assert not calls & {"print", "input", "sleep"}, f"{path} calls {calls & {'print', 'sleep'}}"


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    """The scan is not vacuous: a module importing time is flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom threading import Thread\n")
    assert {"time", "threading"} <= _imports(ast.parse(bad.read_text()))
