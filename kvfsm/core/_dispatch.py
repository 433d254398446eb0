"""Dispatching events through a lifecycle's derived table, run to completion (`Deadlines` lives
in `_deadlines` and is re-exported here).

A `Dispatcher` binds a lifecycle's guards and commands to methods of their owner once, so a step
costs a dict lookup, the guard calls and the command calls. Events raised while a step runs (a
command that completes the aggregate, a peer that wakes its waiters) are queued and run after it, so a
step never sees its instance change under it.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol

from kvfsm.core._deadlines import Deadlines
from kvfsm.lifecycle import Lifecycle, protocol_error

__all__ = [
    "Deadlines",
    "Dispatcher",
    "FlatHistory",
    "History",
    "Instance",
    "RunQueue",
    "Step",
    "StepFailed",
    "unflatten",
]


History = tuple[tuple[str, str, float], ...]
"""A history: (event, state entered, time) per transition taken."""

FlatHistory = tuple[str | float, ...]
"""A history as one flat tuple (event, state entered, time, event, ...), as the core keeps it:
smaller than a tuple per transition, and at 10,000 requests in flight what each request holds
is a cache miss away (docs/performance.md)."""


def unflatten(flat: FlatHistory) -> History:
    """`flat` as (event, state entered, time) per transition."""
    step = iter(flat)
    return tuple(zip(step, step, step, strict=True))  # type: ignore[arg-type]  # by position


class Instance(Protocol):
    """Anything a lifecycle runs on: an id, a state and (optionally kept) history.

    A kept history is a `FlatHistory`, replaced by a longer tuple at each transition: the cycle
    collector stops tracking a tuple of strings and floats within a pass or two, a list never, and
    with 10,000 requests in flight list histories were most of what each full collection
    traversed.
    """

    id: str
    state: str
    history: FlatHistory | None


class Step(NamedTuple):
    """One transition taken: what the conformance check replays through `transitions`."""

    lifecycle: str
    instance: str
    source: str
    event: str
    guards: dict[str, bool]
    dest: str
    commands: tuple[str, ...]


class StepFailed(Exception):
    """A guard or command raised while `event` ran on `inst` (a bug, never a peer's or the
    caller's fault: those are `ProtocolError`s raised before any command runs)."""

    def __init__(self, lifecycle: str, inst: Any, event: str, cause: Exception) -> None:
        super().__init__(f"{lifecycle} {inst.id}: {inst.state} --{event}--> raised {cause!r}")
        self.cause = cause
        self.instances: list[Any] = [inst]
        """The instance whose step raised, then each whose step ran it, innermost first."""


Recorder = Callable[[Step], None]
_Guard = Callable[[Any], bool]
_Action = Callable[[Any], None]
_Rule = tuple[tuple[tuple[str, _Guard, bool], ...], str, tuple[_Action, ...], tuple[str, ...], bool]


class Dispatcher:
    """Runs one lifecycle's table on instances; guards/commands are the owner's `<prefix><name>`.

    The table of names is derived once per lifecycle and prefix; an owner binds a rule's methods
    the first time its (state, event) fires. A core builds three dispatchers and then fires a
    handful of keys: binding all ~100 rules up front was most of a new core's cost, and
    `kvfsm check` builds fresh cores for every state it replays. Looking the methods up by name
    on the owner (not caching functions per class) keeps a subclass's or a patched method.
    """

    def __init__(self, lifecycle: Lifecycle, owner: object, prefix: str, side: str) -> None:
        self.lifecycle = lifecycle
        self.side = side
        self.recorder: Recorder | None = None
        self.on_terminal: Callable[[Any], None] | None = None
        self._owner = owner
        names = _names(lifecycle, prefix)
        names.check(type(owner))
        self._names = names.rules
        self._table: dict[tuple[str, str], tuple[_Rule, ...]] = {}
        self._scratch: dict[str, bool] = {}

    def accepts(self, state: str, event: str) -> bool:
        """Whether `event` has a transition from `state`."""
        return (state, event) in self._names

    def _bind(self, key: tuple[str, str]) -> tuple[_Rule, ...] | None:
        named = self._names.get(key)
        if named is None:
            return None
        owner = self._owner
        rules = self._table[key] = tuple(
            (
                tuple((g, getattr(owner, attr), want) for g, attr, want in guards),
                dest,
                tuple(getattr(owner, attr) for attr in commands),
                names,
                terminal,
            )
            for guards, dest, commands, names, terminal in named
        )
        return rules

    def fire(self, inst: Any, event: str, now: float) -> str:
        """Take the first transition of (inst.state, event) whose guards hold; return its dest.

        Raises the `ProtocolError` of the event's origin when the state does not accept it.
        """
        source = inst.state
        rules = self._table.get((source, event)) or self._bind((source, event))
        if rules is None:
            raise protocol_error(
                self.lifecycle.origins[event],
                inst.id,
                self.side,
                self.lifecycle.name,
                source,
                event,
            )
        # Guard values are kept for a recorder only; otherwise a scratch dict takes them.
        seen: dict[str, bool] = {} if self.recorder is not None else self._scratch
        # The loader guarantees the last rule is unguarded: a lone rule needs no evaluation.
        history = inst.history
        try:
            rule = rules[0] if len(rules) == 1 else _choose(rules, inst, seen)
            _, dest, actions, names, terminal = rule
            inst.state = dest
            if history is not None:
                inst.history = history + (event, dest, now)  # noqa: RUF005 (faster than *)
            if self.recorder is not None:
                self.recorder(Step(self.lifecycle.name, inst.id, source, event, seen, dest, names))
            for action in actions:
                action(inst)
            if terminal and self.on_terminal is not None:
                self.on_terminal(inst)
        except Exception as exc:
            # A bug in a guard or command, here or in a step this one ran: the step did not
            # happen (commands already emitted stay emitted); the owner abandons the instances
            # from where they were.
            inst.state, inst.history = source, history
            if isinstance(exc, StepFailed):
                exc.instances.append(inst)
                raise
            raise StepFailed(self.lifecycle.name, inst, event, exc) from exc
        return dest


def _choose(rules: tuple[_Rule, ...], inst: Any, seen: dict[str, bool]) -> _Rule:
    """The first rule whose guards hold on `inst`, noting each guard's value in `seen`."""
    for candidate in rules:
        for name, guard, want in candidate[0]:
            value = seen[name] = guard(inst)
            if value != want:
                break
        else:
            return candidate
    return rules[-1]


# A rule with the owner's method names in place of the methods.
_NamedRule = tuple[tuple[tuple[str, str, bool], ...], str, tuple[str, ...], tuple[str, ...], bool]


def method_name(prefix: str, kind: Literal["guard", "command"], name: str) -> str:
    """The owner's method that implements guard or command `name` under `prefix`."""
    return f"{prefix}{'guard' if kind == 'guard' else 'cmd'}_{name}"


class _Names:
    """A lifecycle's table for one prefix, keyed by (state, event), methods as names; and the
    owner classes known to implement every one."""

    def __init__(self, lifecycle: Lifecycle, prefix: str) -> None:
        self.rules: dict[tuple[str, str], tuple[_NamedRule, ...]] = {
            (state, event): tuple(
                (
                    tuple((g, method_name(prefix, "guard", g), want) for g, want in r.guards),
                    r.dest,
                    tuple(method_name(prefix, "command", c) for c in r.commands),
                    r.commands,
                    r.dest in lifecycle.terminal,
                )
                for r in rules
            )
            for event, by_state in lifecycle.table.items()
            for state, rules in by_state.items()
        }
        self.implemented: weakref.WeakSet[type] = weakref.WeakSet()

    def check(self, cls: type) -> None:
        """TypeError unless `cls` has every method named (checked once per class)."""
        if cls in self.implemented:
            return
        for guards, _, commands, _, _ in itertools.chain.from_iterable(self.rules.values()):
            for attr in (*(g[1] for g in guards), *commands):
                if not callable(getattr(cls, attr, None)):
                    raise TypeError(f"{cls.__name__} does not implement {attr} named in the model")
        self.implemented.add(cls)


_named: weakref.WeakKeyDictionary[Lifecycle, dict[str, _Names]] = weakref.WeakKeyDictionary()


def _names(lifecycle: Lifecycle, prefix: str) -> _Names:
    by_prefix = _named.setdefault(lifecycle, {})
    names = by_prefix.get(prefix)
    if names is None:
        names = by_prefix[prefix] = _Names(lifecycle, prefix)
    return names


class RunQueue:
    """Events raised during a step, run after it (run-to-completion)."""

    def __init__(self) -> None:
        self.pending: deque[tuple[Dispatcher, Any, str]] = deque()
        """The queued events (empty after most steps: callers test it before `drain`)."""

    def post(self, dispatcher: Dispatcher, inst: Any, event: str) -> None:
        """Queue `event` for `inst`."""
        self.pending.append((dispatcher, inst, event))

    def drain(self, now: float, alive: Callable[[Any], bool]) -> None:
        """Run queued events in order, skipping instances that ended meanwhile."""
        queue = self.pending
        while queue:
            dispatcher, inst, event = queue.popleft()
            if alive(inst):
                dispatcher.fire(inst, event, now)
