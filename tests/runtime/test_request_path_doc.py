"""docs/runtime.md's "The life of a request" names real code: every `path:Class.method` it gives
is a function or method defined in that file, so a move or a rename fails here, not in a reader."""

from __future__ import annotations

import ast
import re
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
_REFERENCE = re.compile(r"`(kvfsm/[\w/]+\.py):([\w.]+)`")


def _section() -> str:
    text = (_REPO / "docs" / "runtime.md").read_text()
    return text.split("## The life of a request", 1)[1].split("\n## ", 1)[0]


def _defined(path: Path) -> set[str]:
    """Qualified names of the functions and methods `path` defines."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return names


def test_every_hop_names_a_function_that_exists() -> None:
    references = _REFERENCE.findall(_section())
    assert len(references) >= 30  # push, pull and the failures
    missing = [f"{p}:{q}" for p, q in references if q not in _defined(_REPO / p)]
    assert not missing, missing


def test_the_check_sees_a_wrong_name() -> None:
    assert "Engine.no_such_hop" not in _defined(_REPO / "kvfsm" / "runtime" / "_engine.py")
    assert "Engine.submit" in _defined(_REPO / "kvfsm" / "runtime" / "_engine.py")
