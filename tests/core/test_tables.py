"""The derived dispatch tables against the real `transitions` machines (the "h2 pattern"), protocol
errors for illegal events, and the `Deadlines`/`Tombstones` bookkeeping."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transitions import MachineError

from kvfsm.core._deadlines import earliest
from kvfsm.core._dispatch import Deadlines, Dispatcher, Step, unflatten
from kvfsm.core._tombstones import Tombstones
from kvfsm.lifecycle import (
    MODEL_NAMES,
    STAY,
    InternalProtocolError,
    Lifecycle,
    LocalProtocolError,
    Origin,
    ProtocolError,
    RemoteProtocolError,
    load,
)

PREFIX = "_x_"
FAULTS = {
    Origin.CALLER: (LocalProtocolError, "caller"),
    Origin.PEER: (RemoteProtocolError, "peer"),
    Origin.FABRIC: (InternalProtocolError, "kvfsm"),
    Origin.TIMER: (InternalProtocolError, "kvfsm"),
    Origin.KVFSM: (InternalProtocolError, "kvfsm"),
}


class Harness:
    """A Dispatcher over an owner whose guards answer `values` and whose commands log."""

    def __init__(self, lc: Lifecycle) -> None:
        self.values: dict[str, bool] = {}
        self.evaluated: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self.steps: list[Step] = []
        self.ended: list[str] = []
        ns: dict[str, Any] = {}
        for g in lc.model.guards:
            ns[f"{PREFIX}guard_{g.name}"] = lambda _self, inst, g=g.name: self._guard(g)
        for c in lc.model.commands:
            ns[f"{PREFIX}cmd_{c.name}"] = lambda _self, inst, c=c.name: self.calls.append(
                (inst.id, c)
            )
        owner = type(f"Owner_{lc.name}", (), ns)()
        self.dispatcher = Dispatcher(lc, owner, PREFIX, lc.model.machine.side)
        self.dispatcher.recorder = self.steps.append
        self.dispatcher.on_terminal = lambda inst: self.ended.append(inst.id)

    def _guard(self, name: str) -> bool:
        self.evaluated.append(name)
        return self.values[name]


def rules_for(lc: Lifecycle, state: str, event: str) -> list[Any]:
    """The TOML transitions for (state, event), in file order (independent of `table`)."""
    return [t for t in lc.model.transitions if t.trigger == event and state in t.source]


def expected_outcome(
    rules: list[Any], state: str, values: dict[str, bool]
) -> tuple[str, list[str]]:
    for t in rules:
        if all(values[g] for g in t.guards) and not any(values[u] for u in t.unless):
            return (state if t.dest == STAY else t.dest), list(t.commands)
    raise AssertionError("no rule matched: the model should end every group unguarded")


PAIRS = [
    pytest.param(name, state, event, id=f"{name}-{state}-{event}")
    for name in MODEL_NAMES
    for state in load(name).states
    for event in load(name).origins
]


def fake(state: str, ident: str = "req-1") -> SimpleNamespace:
    return SimpleNamespace(id=ident, state=state, history=())


@pytest.mark.parametrize(("name", "state", "event"), PAIRS)
def test_every_state_event_pair(name: str, state: str, event: str) -> None:
    lc = load(name)
    rules = rules_for(lc, state, event)
    h = Harness(lc)
    if rules:
        assert h.dispatcher.accepts(state, event)
        referenced = sorted({g for t in rules for g in (*t.guards, *t.unless)})
        for combo in itertools.product([False, True], repeat=len(referenced)):
            values = dict(zip(referenced, combo, strict=True))
            dest, commands = expected_outcome(rules, state, values)
            assert lc.replay(state, event, values) == (dest, commands)
            h.values, h.calls[:] = values, []
            inst = fake(state)
            assert h.dispatcher.fire(inst, event, 1.5) == dest
            assert inst.state == dest
            assert unflatten(inst.history) == ((event, dest, 1.5),)
            assert h.calls == [("req-1", c) for c in commands]
            step = h.steps[-1]
            assert (step.source, step.event, step.dest, step.commands) == (
                state,
                event,
                dest,
                tuple(commands),
            )
            # the guards the dispatcher evaluated are enough for the machine to replay the step
            assert lc.replay(state, event, step.guards) == (dest, commands)
        return
    assert not h.dispatcher.accepts(state, event)
    with pytest.raises(MachineError):
        lc.replay(state, event, {g.name: False for g in lc.model.guards})
    cls, fault = FAULTS[lc.origins[event]]
    inst = fake(state, "req-7f")
    with pytest.raises(ProtocolError) as info:
        h.dispatcher.fire(inst, event, 2.0)
    err = info.value
    assert type(err) is cls
    assert err.fault == fault
    assert (err.request, err.side, err.lifecycle, err.state, err.event) == (
        "req-7f",
        lc.model.machine.side,
        name,
        state,
        event,
    )
    message = str(err)
    for part in ("'req-7f'", f" {lc.model.machine.side} ", f"'{state}'", f"'{event}'", fault):
        assert part in message
    assert inst.state == state and inst.history == () and h.calls == [] and h.steps == []


def test_dispatcher_requires_every_guard_and_command() -> None:
    lc = load("transfer")
    owner = type("Partial", (), {f"{PREFIX}guard_outstanding": lambda self, inst: True})()
    with pytest.raises(TypeError, match="cmd_signal"):
        Dispatcher(lc, owner, PREFIX, "transfer")


def test_a_method_patched_on_the_class_reaches_owners_built_after_it() -> None:
    # Dispatchers share one table of names per lifecycle and bind per owner: planted-bug tests
    # patch a core's class and rely on every core built afterwards running the patch, even
    # where an earlier core of that class already ran the same transition.
    lc, state, event, rule = next(
        (lc, s, e, rules[0])
        for lc in map(load, MODEL_NAMES)
        for e, by_state in lc.table.items()
        for s, rules in by_state.items()
        if len(rules) == 1 and rules[0].commands
    )
    calls: list[str] = []
    ns: dict[str, Any] = {
        f"{PREFIX}guard_{g.name}": lambda self, inst: True for g in lc.model.guards
    }
    ns |= {
        f"{PREFIX}cmd_{c.name}": lambda self, inst: calls.append("old") for c in lc.model.commands
    }
    owner_class = type("Owner", (), ns)
    Dispatcher(lc, owner_class(), PREFIX, lc.model.machine.side).fire(fake(state), event, 0.0)
    assert calls == ["old"] * len(rule.commands)
    setattr(owner_class, f"{PREFIX}cmd_{rule.commands[0]}", lambda self, inst: calls.append("new"))
    calls.clear()
    Dispatcher(lc, owner_class(), PREFIX, lc.model.machine.side).fire(fake(state), event, 0.0)
    assert calls[0] == "new"


@given(st.data())
def test_history_records_every_transition_taken_in_order(data: st.DataObject) -> None:
    """A kept history is one flat tuple; unflattened, it is (event, state entered, time) for
    each transition taken, in order."""
    lc = load(data.draw(st.sampled_from(MODEL_NAMES), label="lifecycle"))
    h = Harness(lc)
    inst = fake(data.draw(st.sampled_from(lc.states), label="start"))
    taken: list[tuple[str, str, float]] = []
    for i in range(data.draw(st.integers(0, 12), label="steps")):
        accepted = sorted(e for e in lc.origins if h.dispatcher.accepts(inst.state, e))
        if not accepted:
            break
        event = data.draw(st.sampled_from(accepted), label="event")
        h.values = {g.name: data.draw(st.booleans(), label=g.name) for g in lc.model.guards}
        taken.append((event, h.dispatcher.fire(inst, event, float(i)), float(i)))
    assert len(inst.history) == 3 * len(taken)
    assert unflatten(inst.history) == tuple(taken)
    untraced = fake(lc.initial)
    untraced.history = None
    h.values = dict.fromkeys((g.name for g in lc.model.guards), True)
    for event in sorted(lc.origins):
        if h.dispatcher.accepts(untraced.state, event):
            h.dispatcher.fire(untraced, event, 0.0)
            break
    assert untraced.history is None


def test_unflatten_refuses_a_torn_history() -> None:
    assert unflatten(()) == ()
    assert unflatten(("admit", "allocated", 1.0)) == (("admit", "allocated", 1.0),)
    with pytest.raises(ValueError):
        unflatten(("admit", "allocated", 1.0, "register"))


@given(st.data())
def test_dispatcher_walk_agrees_with_machine(data: st.DataObject) -> None:
    lc = load(data.draw(st.sampled_from(MODEL_NAMES), label="lifecycle"))
    h = Harness(lc)
    inst = fake(data.draw(st.sampled_from(lc.states), label="start"))
    events = sorted(lc.origins)
    for i in range(data.draw(st.integers(1, 12), label="steps")):
        event = data.draw(st.sampled_from(events), label="event")
        values = {g.name: data.draw(st.booleans(), label=g.name) for g in lc.model.guards}
        h.values, h.calls[:], h.ended[:] = values, [], []
        source = inst.state
        if not h.dispatcher.accepts(source, event):
            with pytest.raises(ProtocolError) as info:
                h.dispatcher.fire(inst, event, float(i))
            assert info.value.fault == FAULTS[lc.origins[event]][1]
            with pytest.raises(MachineError):
                lc.replay(source, event, values)
            assert inst.state == source
            continue
        dest, commands = lc.replay(source, event, values)
        assert h.dispatcher.fire(inst, event, float(i)) == dest
        assert inst.state == dest
        assert unflatten(inst.history)[-1] == (event, dest, float(i))
        assert h.calls == [(inst.id, c) for c in commands]
        assert h.steps[-1].guards == {g: values[g] for g in h.steps[-1].guards}
        assert lc.replay(source, event, h.steps[-1].guards) == (dest, commands)
        assert h.ended == ([inst.id] if dest in lc.terminal else [])


# Deadlines


def drain(d: Deadlines, now: float) -> list[tuple[str, str]]:
    return list(d.due(now))


def test_deadlines_arm_due_disarm() -> None:
    d = Deadlines()
    assert d.next_at() is None and len(d) == 0 and drain(d, math.inf) == []
    d.arm("a", 10.0, "lease_expired")
    d.arm("b", 5.0, "stall_timeout")
    d.arm("c", 7.0, "lease_expired")
    assert len(d) == 3 and d.next_at() == 5.0
    assert drain(d, 4.9) == []
    assert drain(d, 7.0) == [("b", "stall_timeout"), ("c", "lease_expired")]
    assert drain(d, 7.0) == []
    assert len(d) == 1 and d.next_at() == 10.0
    d.disarm("a")
    d.disarm("a")  # twice, and unknown keys, are no-ops
    d.disarm("zz")
    assert len(d) == 0 and d.next_at() is None and drain(d, math.inf) == []


def test_deadlines_heartbeat_reordering() -> None:
    d = Deadlines()
    d.arm("A", 10.0, "lease_expired")
    d.arm("B", 5.0, "lease_expired")
    d.arm("B", 20.0, "lease_expired")  # a heartbeat extends B past A
    assert drain(d, 9.0) == []  # B's stale 5.0 entry is not due any more
    assert d.next_at() == 10.0
    assert drain(d, 10.0) == [("A", "lease_expired")]
    assert d.next_at() == 20.0
    assert drain(d, 19.9) == []
    assert drain(d, 20.0) == [("B", "lease_expired")]
    assert d.next_at() is None and len(d) == 0


def test_deadlines_rearm_earlier_and_new_event_fire_once() -> None:
    d = Deadlines()
    d.arm("A", 10.0, "lease_expired")
    d.arm("A", 3.0, "stall_timeout")
    assert d.next_at() == 3.0
    assert drain(d, 3.0) == [("A", "stall_timeout")]
    assert drain(d, 100.0) == []  # the stale 10.0 entry never fires
    d.arm("A", 50.0, "lease_expired")
    d.disarm("A")
    d.arm("B", 60.0, "lease_expired")
    assert drain(d, 100.0) == [("B", "lease_expired")]


def test_deadlines_hold_only_live_entries_after_many_rearms() -> None:
    d = Deadlines()
    rng = random.Random(7)
    final: dict[str, tuple[float, str]] = {}
    for i in range(10_000):
        key = "abc"[i % 3]
        at, event = rng.uniform(0, 1000), f"e{i}"
        d.arm(key, at, event)
        final[key] = (at, event)
        stored = len(d._heap) + sum(len(run.entries) for run in d._runs.values())
        assert stored == len(final)  # a re-arm replaces the old entry at once: nothing stale
    assert len(d) == 3
    order = sorted(final.items(), key=lambda kv: kv[1][0])
    assert d.next_at() == order[0][1][0]
    assert drain(d, order[1][1][0]) == [(k, e) for k, (_, e) in order[:2]]
    assert drain(d, math.inf) == [(order[2][0], order[2][1][1])]
    assert len(d) == 0 and d.next_at() is None


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arm"), st.sampled_from("abcd"), st.integers(0, 30)),
        st.tuples(st.just("disarm"), st.sampled_from("abcd"), st.just(0)),
        st.tuples(st.just("due"), st.just(""), st.integers(0, 30)),
        st.tuples(st.just("next_at"), st.just(""), st.just(0)),
    ),
    max_size=120,
)


@given(OPS)
def test_deadlines_match_reference(ops: list[tuple[str, str, int]]) -> None:
    d, ref = Deadlines(), {}
    for n, (op, key, t) in enumerate(ops):
        if op == "arm":
            d.arm(key, float(t), f"ev{n}")
            ref[key] = (float(t), f"ev{n}")
        elif op == "disarm":
            d.disarm(key)
            ref.pop(key, None)
        elif op == "next_at":
            assert d.next_at() == min((at for at, _ in ref.values()), default=None)
        else:
            got = drain(d, float(t))
            want = {(k, e) for k, (at, e) in ref.items() if at <= t}
            assert len(got) == len(want) and set(got) == want
            ats = [ref[k][0] for k, _ in got]
            assert ats == sorted(ats)
            for k, _ in got:
                del ref[k]
        assert len(d) == len(ref)


@given(st.lists(st.none() | st.floats(allow_nan=False), max_size=5))
def test_earliest_is_the_min_of_the_times_set(times: list[float | None]) -> None:
    assert earliest(*times) == min((t for t in times if t is not None), default=None)


def test_tombstones_evict_oldest_first() -> None:
    t = Tombstones(3)
    for i, key in enumerate("abcd"):
        t.add(key, f"s{i}")
    assert len(t) == 3
    assert "a" not in t and t.get("a") is None
    assert [t.get(k) for k in "bcd"] == ["s1", "s2", "s3"]
    t.add("e", "s4")
    t.add("f", "s5")
    assert [k in t for k in "bcdef"] == [False, False, True, True, True]
    assert t.get("f") == "s5" and len(t) == 3
