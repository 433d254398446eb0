"""The lifecycle models as typed data: decoding and validating the TOML files in models/.

A model file declares one machine: its states, the events it accepts (with whose fault an illegal one
is), the guards and commands its transitions may name, and the transitions themselves. Everything a
transition refers to must be declared; a malformed file fails at load with `ModelError` naming the
file, the transition and the problem.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from pathlib import Path

import msgspec

__all__ = [
    "STAY",
    "CommandSpec",
    "EventSpec",
    "GuardSpec",
    "LifecycleModel",
    "MachineSpec",
    "ModelError",
    "Origin",
    "StateSpec",
    "TransitionSpec",
    "decode_model",
]

STAY = "="
"""A transition's `dest` that keeps the source state (an internal transition)."""


class ModelError(ValueError):
    """A model file is malformed; the message names the file, the transition and the problem."""


class Origin(enum.Enum):
    """Where an event comes from, and so whose fault it is when a state does not accept it."""

    CALLER = "caller"  # the serving engine driving kvfsm (scheduler calls)
    PEER = "peer"  # the remote engine (registrations, notifications)
    FABRIC = "fabric"  # the transfer fabric (transfer results)
    TIMER = "timer"  # a deadline kvfsm armed itself
    KVFSM = "kvfsm"  # an internal step of kvfsm itself


class MachineSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The header of a model file."""

    name: str
    side: str  # "P", "D", "peer" or "transfer"
    mode: str  # "push", "pull" or "any"
    initial: str
    description: str


class StateSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A named state. Terminal states have no way out; `holds_blocks` says who owns the blocks."""

    name: str
    description: str
    terminal: bool = False
    holds_blocks: bool = True


class EventSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An input event the machine reacts to."""

    name: str
    origin: Origin
    description: str


class GuardSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A named condition a transition may require (or require false, with `unless`)."""

    name: str
    description: str


class CommandSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A named output a transition emits, executed outside the core."""

    name: str
    description: str


class TransitionSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One transition: on `trigger`, from any of `source`, when every guard holds and no `unless`
    guard holds, go to `dest` and emit `commands` in order."""

    trigger: str
    source: list[str]
    dest: str
    guards: list[str] = []
    unless: list[str] = []
    commands: list[str] = []
    note: str = ""


class LifecycleModel(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A whole model file."""

    machine: MachineSpec
    states: list[StateSpec]
    events: list[EventSpec]
    transitions: list[TransitionSpec]
    guards: list[GuardSpec] = []
    commands: list[CommandSpec] = []

    def state(self, name: str) -> StateSpec:
        """The state called `name`."""
        return next(s for s in self.states if s.name == name)

    def event(self, name: str) -> EventSpec:
        """The event called `name`."""
        return next(e for e in self.events if e.name == name)


def decode_model(path: Path) -> LifecycleModel:
    """Decode and validate one model file; raise `ModelError` on any problem."""
    try:
        model = msgspec.toml.decode(path.read_bytes(), type=LifecycleModel)
    except msgspec.ValidationError as exc:
        raise ModelError(f"{path.name}: {exc}") from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path.name}: not valid TOML: {exc}") from exc
    problems = _problems(model)
    if problems:
        raise ModelError(f"{path.name}: " + "; ".join(problems))
    return model


def _declared(kind: str, names: list[str]) -> tuple[set[str], list[str]]:
    counts = Counter(names)
    return set(names), [f"{kind} '{n}' declared {c} times" for n, c in counts.items() if c > 1]


def _problems(model: LifecycleModel) -> list[str]:
    states, problems = _declared("state", [s.name for s in model.states])
    events, more = _declared("event", [e.name for e in model.events])
    problems += more
    guards, more = _declared("guard", [g.name for g in model.guards])
    problems += more
    commands, more = _declared("command", [c.name for c in model.commands])
    problems += more
    if model.machine.initial not in states:
        problems.append(f"initial state '{model.machine.initial}' is not a declared state")
    terminal = {s.name for s in model.states if s.terminal}
    for i, t in enumerate(model.transitions):
        where = f"transition #{i} ({t.trigger}: {', '.join(t.source)} -> {t.dest})"
        checks = [
            (t.trigger in events, f"unknown event '{t.trigger}'"),
            (bool(t.source), "no source state"),
            (t.dest in states or t.dest == STAY, f"unknown destination state '{t.dest}'"),
        ]
        checks += [(s in states, f"unknown source state '{s}'") for s in t.source]
        checks += [(s not in terminal, f"source '{s}' is terminal") for s in t.source]
        checks += [(g in guards, f"unknown guard '{g}'") for g in (*t.guards, *t.unless)]
        checks += [(c in commands, f"unknown command '{c}'") for c in t.commands]
        problems += [f"{where}: {msg}" for ok, msg in checks if not ok]
    used_guards = {g for t in model.transitions for g in (*t.guards, *t.unless)}
    used_commands = {c for t in model.transitions for c in t.commands}
    used_events = {t.trigger for t in model.transitions}
    for kind, declared, used in (
        ("event", events, used_events),
        ("guard", guards, used_guards),
        ("command", commands, used_commands),
    ):
        problems += [
            f"{kind} '{n}' is declared but no transition uses it" for n in sorted(declared - used)
        ]
    problems += _shadowed(model)
    if not problems:
        problems += _unreachable(model, terminal)
    return problems


def _shadowed(model: LifecycleModel) -> list[str]:
    """A transition after an unguarded one for the same (source, trigger) can never fire, and the
    last one must be unguarded, so that every accepted event has exactly one outcome."""
    unguarded: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], int] = {}
    problems = []
    for i, t in enumerate(model.transitions):
        for s in t.source:
            key = (s, t.trigger)
            if key in unguarded:
                problems.append(
                    f"transition #{i} ({t.trigger}: {s} -> {t.dest}) can never fire: "
                    f"transition #{unguarded[key]} takes every '{t.trigger}' in '{s}' first"
                )
            elif not t.guards and not t.unless:
                unguarded[key] = i
            last[key] = i
    for (s, trigger), i in last.items():
        if (s, trigger) not in unguarded:
            problems.append(
                f"transition #{i} ({trigger}: {s}): every '{trigger}' transition from '{s}' is "
                "guarded; add an unguarded one last so every case has an outcome"
            )
    return problems


def _unreachable(model: LifecycleModel, terminal: set[str]) -> list[str]:
    """Every state is reachable from the initial one and can reach a terminal state."""
    forward: dict[str, set[str]] = {s.name: set() for s in model.states}
    backward: dict[str, set[str]] = {s.name: set() for s in model.states}
    for t in model.transitions:
        for s in t.source:
            dest = s if t.dest == STAY else t.dest
            forward[s].add(dest)
            backward[dest].add(s)
    reached = _closure(forward, {model.machine.initial})
    can_end = _closure(backward, terminal)
    initial = model.machine.initial
    problems = [f"state '{s}' is unreachable from '{initial}'" for s in forward if s not in reached]
    problems += [
        f"state '{s}' can never reach a terminal state" for s in forward if s not in can_end
    ]
    return problems


def _closure(edges: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(start), deque(start)
    while todo:
        for nxt in edges[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen
