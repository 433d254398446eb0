"""The scenario loader against any file: random bytes, the library's files with bytes and TOML
tokens mutated, and their decoded tables mutated (values of every TOML type, NaN and infinities,
huge integers, dates, missing and unknown keys, values borrowed from elsewhere in the file) and
written back. `load_scenario` returns a `Scenario` whose cross-checked parts hold, or raises
`ScenarioError` naming the file and the place; never another exception."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.cli.scenario import Scenario, ScenarioError, load_scenario
from kvfsm.cli.scenario._file import core_config
from kvfsm.fabric import SimFaults
from tests.fuzz.strategies import leaves_from, mutated_trees, toml_dumps, toml_leaves

LIBRARY = sorted((Path(__file__).parents[1] / "scenarios").glob("*.toml"))
TEXTS = [path.read_bytes() for path in LIBRARY]
TREES = [tomllib.loads(text.decode()) for text in TEXTS]
VOCABULARY = leaves_from(*TREES)  # "D#0", "push", "until", "done", 0.7, ...

PLACE = re.compile(
    r"at `\$[^`]*`"  # msgspec's path: $.engines[0].tp
    r"|line \d+|at end of document"  # TOML syntax and encoding errors
    r"|field `[^`]*`"  # a missing or unknown field of the top table, named (even "")
    r"|^(engines|requests|timeline\[\d+\]|expect\[\d+\]|config/network|network|fabrics):"
    r"|nested too deeply"
)
"""What names the place of a problem, after the file's name."""

TOKENS = [
    b"[",
    b"]",
    b"{",
    b"}",
    b"=",
    b",",
    b'"',
    b"'",
    b"\n",
    b"#",
    b".",
    b"nan",
    b"-inf",
    b"1e999",
    b"99999999999999999999",
    b"1979-05-27T07:32:00Z",
    b"[[engines]]",
    b"[config]",
    b'"""',
    b"\\u0000",
    b"\xff",
    b"\xef\xbb\xbf",
    b"true",
    b"D#9",
    b"P",
    b"pull",
]


@pytest.fixture(scope="module")
def file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scenarios") / "fuzzed.toml"


def check_load(file: Path, data: bytes) -> Scenario | None:
    """Load `data` from `file`: a scenario whose parts hold, or a `ScenarioError` that names
    the file and the place."""
    file.write_bytes(data)
    try:
        scenario = load_scenario(file)
    except ScenarioError as exc:
        text = str(exc)
        assert text.startswith(f"{file}: "), text
        assert PLACE.search(text.removeprefix(f"{file}: ")), text
        return None
    # What the loader promises of a scenario it returns: one P, one D, references resolved,
    # a configuration and a network the simulated cluster takes.
    assert sorted(e.side for e in scenario.engines) == ["D", "P"]
    core_config(scenario)
    SimFaults(**scenario.network)
    names = {r.id for r in scenario.requests}
    for step in scenario.timeline:
        assert getattr(step, "request", next(iter(names), None)) in names
        assert getattr(step, "agent", scenario.agents()[0]) in scenario.agents()
    return scenario


def test_the_library_loads(file: Path) -> None:
    # The mutations start from files that load.
    assert all(check_load(file, text) is not None for text in TEXTS)


@settings(max_examples=200)
@given(st.binary(max_size=256))
def test_any_bytes(file: Path, data: bytes) -> None:
    check_load(file, data)


@st.composite
def mutated_text(draw: st.DrawFn) -> bytes:
    """A library file with a few TOML tokens inserted, bytes deleted, or the file cut."""
    buf = bytearray(draw(st.sampled_from(TEXTS)))
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(buf)))
        kind = draw(st.sampled_from(["token", "token", "delete", "cut", "byte"]))
        if kind == "token":
            buf[pos:pos] = draw(st.sampled_from(TOKENS))
        elif kind == "delete":
            del buf[pos : pos + draw(st.integers(1, 12))]
        elif kind == "cut":
            del buf[pos:]
        elif pos < len(buf):
            buf[pos] = draw(st.integers(0, 255))
    return bytes(buf)


@settings(max_examples=250)
@given(mutated_text())
def test_mutated_files(file: Path, data: bytes) -> None:
    check_load(file, data)


leaves = st.one_of(toml_leaves, st.sampled_from(VOCABULARY), st.sampled_from(VOCABULARY))


@settings(max_examples=250)
@given(st.sampled_from(TREES).flatmap(lambda tree: mutated_trees(tree, leaves, 4)))
def test_mutated_tables(file: Path, tree: dict[str, Any]) -> None:
    text = toml_dumps(tree)
    tomllib.loads(text)  # the writer's own check: the loader gets valid TOML to refuse or take
    check_load(file, text.encode())


@pytest.mark.parametrize(
    "data",
    [
        b"x = " + b"[" * 100_000 + b"]" * 100_000,
        b"x = " + b"{a=" * 5000 + b"1" + b"}" * 5000,
        b'description = "\xff\xfe"\n',
        b"\xff" * 10,
        TEXTS[0].replace(b'"', b"\xc0\x80", 1),  # an overlong NUL
    ],
    ids=["deep-arrays", "deep-tables", "latin-1-string", "not-text", "overlong-utf8"],
)
def test_deep_nesting_and_bad_encodings_are_scenario_errors(file: Path, data: bytes) -> None:
    # These raised RecursionError and UnicodeDecodeError out of load_scenario before.
    file.write_bytes(data)
    with pytest.raises(ScenarioError, match=re.escape(str(file)) + ": not (valid TOML|UTF-8)"):
        load_scenario(file)
