"""Lifecycles: a model file loaded into a `transitions` machine, and the dispatch table derived from it.

The `transitions.Machine` built here is the authority. The core does not trigger it per request (a
trigger and a model per request cost far more than a lookup); it dispatches through `Lifecycle.table`,
which is read off the machine object's own events and transitions, never written by hand. The test
suite replays every step the core takes through the machine itself (`Lifecycle.replay`) and checks both
agree. See docs/lifecycles.md.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transitions import Machine, MachineError

from kvfsm.lifecycle._model import STAY, LifecycleModel, Origin, decode_model

__all__ = ["MODEL_NAMES", "Lifecycle", "Rule", "load", "models_dir"]

MODEL_NAMES = (
    "producer_push",
    "consumer_push",
    "producer_pull",
    "consumer_pull",
    "peer",
    "transfer",
    "engine",
)

_GUARD = "guard_"
_COMMAND = "cmd_"


@dataclass(frozen=True, slots=True)
class Rule:
    """One way out of a state on an event: when the guards hold, go to `dest`, emit `commands`."""

    guards: tuple[tuple[str, bool], ...]
    dest: str
    commands: tuple[str, ...]


@dataclass(eq=False)
class Lifecycle:
    """A validated model, its `transitions` machine and the dispatch table derived from it."""

    model: LifecycleModel
    machine: Machine = field(init=False, repr=False)
    table: dict[str, dict[str, tuple[Rule, ...]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.machine = _build_machine(self.model)
        self.table = _derive_table(self.machine)

    @property
    def name(self) -> str:
        """The model's name, e.g. ``producer_push``."""
        return self.model.machine.name

    @property
    def initial(self) -> str:
        """The state a new instance starts in."""
        return self.model.machine.initial

    @functools.cached_property
    def states(self) -> tuple[str, ...]:
        """Every state, in model order."""
        return tuple(s.name for s in self.model.states)

    @functools.cached_property
    def terminal(self) -> frozenset[str]:
        """The terminal states."""
        return frozenset(s.name for s in self.model.states if s.terminal)

    @functools.cached_property
    def origins(self) -> dict[str, Origin]:
        """Where each event comes from (whose fault an illegal one is)."""
        return {e.name: e.origin for e in self.model.events}

    @functools.cached_property
    def edges(self) -> frozenset[tuple[str, str, str]]:
        """Every (source, event, dest) the model allows: the transitions coverage is measured on."""
        return frozenset(
            (src, event, rule.dest)
            for event, by_state in self.table.items()
            for src, rules in by_state.items()
            for rule in rules
        )

    def replay(self, state: str, event: str, guards: Mapping[str, bool]) -> tuple[str, list[str]]:
        """Run one step through the real `transitions` machine: return (dest, commands emitted).

        `guards` gives the value of each guard the step evaluated. Raises `MachineError` when the
        machine does not accept `event` in `state`.
        """
        shadow = _Shadow(guards)
        self.machine.add_model(shadow, initial=state)
        try:
            shadow.trigger(event)
            return shadow.state, shadow.emitted
        finally:
            self.machine.remove_model(shadow)


class _Shadow:
    """A model object for `transitions` whose guards answer recorded values and whose commands log."""

    state: str
    trigger: Callable[..., bool]

    def __init__(self, guards: Mapping[str, bool]) -> None:
        self._guards = guards
        self.emitted: list[str] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith(_GUARD):
            guard = name.removeprefix(_GUARD)
            if guard not in self._guards:
                raise MachineError(f"guard '{guard}' was not evaluated by the core")
            return lambda *_: self._guards[guard]
        if name.startswith(_COMMAND):
            command = name.removeprefix(_COMMAND)
            return lambda *_: self.emitted.append(command)
        raise AttributeError(name)


def _build_machine(model: LifecycleModel) -> Machine:
    machine = Machine(
        model=None,
        states=[s.name for s in model.states],
        initial=model.machine.initial,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )
    for t in model.transitions:
        machine.add_transition(
            t.trigger,
            list(t.source),
            None if t.dest == STAY else t.dest,
            conditions=[_GUARD + g for g in t.guards],
            unless=[_GUARD + g for g in t.unless],
            after=[_COMMAND + c for c in t.commands],
        )
    return machine


def _derive_table(machine: Machine) -> dict[str, dict[str, tuple[Rule, ...]]]:
    """Read the dispatch table off the machine: event -> source state -> rules in firing order."""
    table: dict[str, dict[str, tuple[Rule, ...]]] = {}
    for name, event in machine.events.items():
        table[name] = {
            source: tuple(
                Rule(
                    guards=tuple(
                        (str(c.func).removeprefix(_GUARD), c.target) for c in t.conditions
                    ),
                    dest=source if t.dest is None else t.dest,
                    commands=tuple(str(a).removeprefix(_COMMAND) for a in t.after),
                )
                for t in transitions
            )
            for source, transitions in event.transitions.items()
        }
    return table


def models_dir() -> Path:
    """Where the model files live: ``$KVFSM_MODELS_DIR`` or the packaged models/."""
    override = os.environ.get("KVFSM_MODELS_DIR")
    if override:
        return Path(override)
    return Path(str(importlib.resources.files("kvfsm") / "_models"))


@functools.cache
def load(name: str) -> Lifecycle:
    """Load, validate and build the lifecycle called `name` (cached)."""
    return Lifecycle(decode_model(models_dir() / f"{name}.toml"))
