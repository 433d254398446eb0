"""The lifecycle model files: every one loads into a `transitions` machine whose derived table is the
TOML, and malformed files fail at load with a `ModelError` naming the file, transition and problem."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfsm.lifecycle import (
    MODEL_NAMES,
    STAY,
    Lifecycle,
    ModelError,
    Origin,
    decode_model,
    load,
    models_dir,
)

Doc = dict[str, Any]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_loads_and_table_matches_toml(name: str) -> None:
    lc = load(name)
    assert isinstance(lc, Lifecycle)
    model = decode_model(models_dir() / f"{name}.toml")
    assert lc.name == name == model.machine.name
    assert lc.initial == model.machine.initial
    assert lc.states == tuple(s.name for s in model.states)
    assert lc.terminal == {s.name for s in model.states if s.terminal}
    assert lc.terminal, "a lifecycle without terminal states never ends"
    assert lc.origins == {e.name: e.origin for e in model.events}

    expected: dict[str, dict[str, list[tuple[Any, ...]]]] = {}
    for t in model.transitions:  # file order
        rule = (
            tuple((g, True) for g in t.guards) + tuple((g, False) for g in t.unless),
            None if t.dest == STAY else t.dest,
            tuple(t.commands),
        )
        for src in t.source:
            dest = src if rule[1] is None else rule[1]
            expected.setdefault(t.trigger, {}).setdefault(src, []).append((rule[0], dest, rule[2]))
    actual = {
        event: {src: [(r.guards, r.dest, r.commands) for r in rules] for src, rules in by.items()}
        for event, by in lc.table.items()
    }
    assert actual == expected
    assert lc.edges == {
        (src, event, r[1]) for event, by in expected.items() for src, rs in by.items() for r in rs
    }
    # the table is read off the machine: the machine's own transitions agree
    for event, by in expected.items():
        machine_event = lc.machine.events[event]
        assert set(machine_event.transitions) == set(by)


# A minimal valid model, mutated below into each kind of malformed file.
BASE: Doc = {
    "machine": {"name": "m", "side": "P", "mode": "push", "initial": "a", "description": "d"},
    "states": [
        {"name": "a", "description": "d"},
        {"name": "b", "description": "d"},
        {"name": "end", "description": "d", "terminal": True, "holds_blocks": False},
    ],
    "events": [
        {"name": "go", "origin": "caller", "description": "d"},
        {"name": "stop", "origin": "peer", "description": "d"},
    ],
    "guards": [{"name": "g", "description": "d"}],
    "commands": [{"name": "c", "description": "d"}],
    "transitions": [
        {"trigger": "go", "source": ["a"], "dest": "b", "guards": ["g"], "commands": ["c"]},
        {"trigger": "go", "source": ["a"], "dest": "b"},
        {"trigger": "stop", "source": ["b"], "dest": "end", "commands": ["c"]},
    ],
}


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)  # ints, strings and lists of strings are valid TOML as JSON


def to_toml(doc: Doc) -> str:
    lines = ["[machine]", *(f"{k} = {_value(v)}" for k, v in doc["machine"].items())]
    for table in ("states", "events", "guards", "commands", "transitions"):
        for item in doc[table]:
            lines += [f"[[{table}]]", *(f"{k} = {_value(v)}" for k, v in item.items())]
    return "\n".join(lines) + "\n"


def test_base_model_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "base.toml"
    path.write_text(to_toml(BASE))
    model = decode_model(path)
    assert [t.trigger for t in model.transitions] == ["go", "go", "stop"]
    assert model.event("stop").origin is Origin.PEER
    assert Lifecycle(model).table["go"]["a"][0].guards == (("g", True),)


def _t(doc: Doc, i: int, **fields: Any) -> None:
    doc["transitions"][i].update(fields)


def _add(doc: Doc, table: str, **fields: Any) -> Doc:
    doc[table].append({"description": "d", **fields} if table != "transitions" else fields)
    return doc  # a value, so that one mutation can chain several in a tuple


MUTATIONS: list[tuple[str, Callable[[Doc], object], list[str]]] = [
    (
        "unknown_dest",
        lambda d: _t(d, 1, dest="nowhere"),
        ["transition #1 (go: a -> nowhere)", "unknown destination state 'nowhere'"],
    ),
    (
        "unknown_source",
        lambda d: _t(d, 2, source=["b", "zz"]),
        ["transition #2 (stop: b, zz -> end)", "unknown source state 'zz'"],
    ),
    (
        "unknown_event",
        lambda d: _t(d, 2, trigger="fly"),
        ["transition #2 (fly: b -> end)", "unknown event 'fly'"],
    ),
    (
        "unknown_guard",
        lambda d: _t(d, 0, guards=["h"]),
        ["transition #0 (go: a -> b)", "unknown guard 'h'"],
    ),
    (
        "unknown_unless",
        lambda d: _t(d, 0, guards=[], unless=["h"]),
        ["transition #0 (go: a -> b)", "unknown guard 'h'"],
    ),
    (
        "unknown_command",
        lambda d: _t(d, 2, commands=["c", "x"]),
        ["transition #2 (stop: b -> end)", "unknown command 'x'"],
    ),
    (
        "no_source",
        lambda d: _t(d, 2, source=[]),
        ["transition #2 (stop:  -> end)", "no source state"],
    ),
    (
        "from_terminal",
        lambda d: _add(d, "transitions", trigger="go", source=["end"], dest="a"),
        ["transition #3 (go: end -> a)", "source 'end' is terminal"],
    ),
    (
        "unreachable",
        lambda d: (
            _add(d, "states", name="island"),
            _add(d, "transitions", trigger="stop", source=["island"], dest="end"),
        ),
        ["state 'island' is unreachable from 'a'"],
    ),
    (
        "cannot_end",
        lambda d: (
            _add(d, "states", name="trap"),
            _add(d, "transitions", trigger="go", source=["b"], dest="trap"),
            _add(d, "transitions", trigger="go", source=["trap"], dest="="),
        ),
        ["state 'trap' can never reach a terminal state"],
    ),
    (
        "guarded_only",
        lambda d: _t(d, 2, guards=["g"]),
        ["transition #2 (stop: b)", "every 'stop' transition from 'b' is guarded"],
    ),
    (
        "shadowed",
        lambda d: _add(d, "transitions", trigger="go", source=["a"], dest="end"),
        ["transition #3 (go: a -> end) can never fire", "transition #1 takes every 'go' in 'a'"],
    ),
    ("duplicate_state", lambda d: _add(d, "states", name="b"), ["state 'b' declared 2 times"]),
    (
        "duplicate_event",
        lambda d: _add(d, "events", name="go", origin="peer"),
        ["event 'go' declared 2 times"],
    ),
    (
        "duplicate_command",
        lambda d: _add(d, "commands", name="c"),
        ["command 'c' declared 2 times"],
    ),
    (
        "initial_undeclared",
        lambda d: d["machine"].update(initial="nope"),
        ["initial state 'nope' is not a declared state"],
    ),
    (
        "dest_not_str",
        lambda d: _t(d, 1, dest=3),
        ["Expected `str`, got `int`", "$.transitions[1].dest"],
    ),
    (
        "unknown_field",
        lambda d: _t(d, 2, priority=1),
        ["unknown field `priority`", "$.transitions[2]"],
    ),
    (
        "bad_origin",
        lambda d: d["events"][0].update(origin="martian"),
        ["'martian'", "$.events[0].origin"],
    ),
    (
        "missing_field",
        lambda d: d["transitions"][2].pop("dest"),
        ["missing required field `dest`", "$.transitions[2]"],
    ),
]


@pytest.mark.parametrize(("case", "mutate", "expected"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_malformed_model_fails_at_load(
    tmp_path: Path, case: str, mutate: Callable[[Doc], None], expected: list[str]
) -> None:
    doc = copy.deepcopy(BASE)
    mutate(doc)
    path = tmp_path / f"broken_{case}.toml"
    path.write_text(to_toml(doc))
    with pytest.raises(ModelError) as info:
        decode_model(path)
    message = str(info.value)
    assert message.startswith(f"broken_{case}.toml: ")
    for part in expected:
        assert part in message


@pytest.mark.parametrize(
    "text",
    [
        '[machine\nname = "m"\n',
        '[machine]\nname = "m\n',
        '[machine]\nname = "m"\nname = "n"\n',
        "[[states]]\nname = ",
    ],
)
def test_invalid_toml_fails_at_load(tmp_path: Path, text: str) -> None:
    path = tmp_path / "garbled.toml"
    path.write_text(to_toml(BASE) + text)
    with pytest.raises(ModelError, match=r"^garbled\.toml: not valid TOML: "):
        decode_model(path)


def test_non_utf8_model_fails_with_model_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(to_toml(BASE).replace('"d"', '"caf\xe9"').encode("latin-1"))
    with pytest.raises(ModelError, match=r"^latin1\.toml: "):
        decode_model(path)
