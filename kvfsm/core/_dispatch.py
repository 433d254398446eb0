"""Dispatching events through a lifecycle's derived table, run to completion, and deadlines.

A `Dispatcher` binds a lifecycle's guards and commands to methods of their owner once, so a step
costs a dict lookup, the guard calls and the command calls. Events raised while a step runs (a
command that completes the aggregate, a peer that wakes its waiters) are queued and run after it, so a
step never sees its instance change under it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

from kvfsm.lifecycle import Lifecycle, protocol_error

__all__ = ["Deadlines", "Dispatcher", "Instance", "RunQueue", "Step", "Tombstones"]


class Instance(Protocol):
    """Anything a lifecycle runs on: an id, a state and (optionally kept) history."""

    id: str
    state: str
    history: list[tuple[str, str, float]] | None


class Step(NamedTuple):
    """One transition taken: what the conformance check replays through `transitions`."""

    lifecycle: str
    instance: str
    source: str
    event: str
    guards: dict[str, bool]
    dest: str
    commands: tuple[str, ...]


Recorder = Callable[[Step], None]
_Guard = Callable[[Any], bool]
_Action = Callable[[Any], None]
_Compiled = tuple[
    tuple[tuple[tuple[str, _Guard, bool], ...], str, tuple[_Action, ...], tuple[str, ...]], ...
]


class Dispatcher:
    """Runs one lifecycle's table on instances; guards/commands are the owner's `<prefix><name>`."""

    def __init__(self, lifecycle: Lifecycle, owner: object, prefix: str, side: str) -> None:
        self.lifecycle = lifecycle
        self.side = side
        self.recorder: Recorder | None = None
        self.on_terminal: Callable[[Any], None] | None = None
        self._terminal = lifecycle.terminal
        self._table: dict[tuple[str, str], _Compiled] = {}
        for event, by_state in lifecycle.table.items():
            for state, rules in by_state.items():
                self._table[(state, event)] = tuple(
                    (
                        tuple(
                            (g, _bind(owner, f"{prefix}guard_{g}"), want) for g, want in r.guards
                        ),
                        r.dest,
                        tuple(_bind(owner, f"{prefix}cmd_{c}") for c in r.commands),
                        r.commands,
                    )
                    for r in rules
                )

    def accepts(self, state: str, event: str) -> bool:
        """Whether `event` has a transition from `state`."""
        return (state, event) in self._table

    def fire(self, inst: Any, event: str, now: float) -> str:
        """Take the first transition of (inst.state, event) whose guards hold; return its dest.

        Raises the `ProtocolError` of the event's origin when the state does not accept it.
        """
        source = inst.state
        rules = self._table.get((source, event))
        if rules is None:
            raise protocol_error(
                self.lifecycle.origins[event],
                inst.id,
                self.side,
                self.lifecycle.name,
                source,
                event,
            )
        seen: dict[str, bool] = {}
        rule = rules[-1]  # the loader guarantees the last rule is unguarded
        for candidate in rules:
            for name, guard, want in candidate[0]:
                value = seen[name] = guard(inst)
                if value != want:
                    break
            else:
                rule = candidate
                break
        _, dest, actions, names = rule
        inst.state = dest
        if inst.history is not None:
            inst.history.append((event, dest, now))
        if self.recorder is not None:
            self.recorder(Step(self.lifecycle.name, inst.id, source, event, seen, dest, names))
        for action in actions:
            action(inst)
        if dest in self._terminal and self.on_terminal is not None:
            self.on_terminal(inst)
        return dest


def _bind(owner: object, attr: str) -> Callable[[Any], Any]:
    fn = getattr(owner, attr, None)
    if fn is None:
        raise TypeError(f"{type(owner).__name__} does not implement {attr} named in the model")
    return fn  # type: ignore[no-any-return]


class Deadlines:
    """One deadline per instance, in a heap with lazy invalidation.

    Re-arming (a heartbeat extending a lease) pushes a new entry and bumps the instance's generation;
    stale entries are skipped when they surface and compacted away when they outnumber live ones, so
    a sweep touches only due entries and reordered deadlines are all found.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, int, str]] = []
        self._live: dict[str, tuple[int, float, str]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def arm(self, key: str, at: float, event: str) -> None:
        """Set `key`'s deadline to `at`, firing `event`; replaces any earlier one."""
        gen = next(self._seq)
        self._live[key] = (gen, at, event)
        heapq.heappush(self._heap, (at, gen, key, gen, event))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(a, g, k, g, e) for k, (g, a, e) in self._live.items()]
            heapq.heapify(self._heap)

    def disarm(self, key: str) -> None:
        """Forget `key`'s deadline."""
        self._live.pop(key, None)

    def due(self, now: float) -> Iterator[tuple[str, str]]:
        """Pop every live deadline at or before `now`: (key, event)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, key, gen, event = heapq.heappop(heap)
            live = self._live.get(key)
            if live is not None and live[0] == gen:
                del self._live[key]
                yield key, event

    def next_at(self) -> float | None:
        """When the earliest live deadline falls, if any (for an event loop's timeout)."""
        while self._heap:
            at, _, key, gen, _ = self._heap[0]
            live = self._live.get(key)
            if live is not None and live[0] == gen:
                return at
            heapq.heappop(self._heap)
        return None


class Tombstones:
    """A bounded memory of finished ids and how they ended, to tell late messages from unknown ones."""

    def __init__(self, capacity: int) -> None:
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity

    def __contains__(self, key: object) -> bool:
        return key in self._ended

    def __len__(self) -> int:
        return len(self._ended)

    def add(self, key: str, state: str) -> None:
        """Remember that `key` ended in `state`; forget the oldest beyond capacity."""
        self._ended[key] = state
        self._ended.move_to_end(key)
        if len(self._ended) > self._capacity:
            self._ended.popitem(last=False)

    def get(self, key: str) -> str | None:
        """How `key` ended, if remembered."""
        return self._ended.get(key)


class RunQueue:
    """Events raised during a step, run after it (run-to-completion)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Dispatcher, Any, str]] = deque()

    def post(self, dispatcher: Dispatcher, inst: Any, event: str) -> None:
        """Queue `event` for `inst`."""
        self._queue.append((dispatcher, inst, event))

    def drain(self, now: float, alive: Callable[[Any], bool]) -> None:
        """Run queued events in order, skipping instances that ended meanwhile."""
        while self._queue:
            dispatcher, inst, event = self._queue.popleft()
            if alive(inst):
                dispatcher.fire(inst, event, now)
