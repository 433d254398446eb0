"""`kvfsm check`: a bounded exhaustive exploration of the core on the simulated fabric.

1 P and 1 D engine (TP 1) on a `Cluster`, `requests` requests (r1 of 2 blocks, r2 of 1: the
core sees a block count only as "none or some"), at most `max_faults` faults and `max_depth`
actions per path. At every state each enabled action is tried: admit the next request, P or D
first (r2 after r1: they are interchangeable); finish a prefill; abort on P or on D (once per side,
while it holds the request); drain P (once; no request is admitted after it); advance the clock to the next due thing (a notification or transfer
completion, a deadline, heartbeat or sweep, a handshake: time is discrete, engines poll the
instant something is due); or a fault: drop, duplicate or delay (`DELAY_S`) a notification in
flight, make a transfer in flight end ERR or hang, fail the poster's next post, fail a handshake
under way, kill or silence an agent. A fault hits one pending event, so each can be the one.
The fabric has UCX-over-TCP's quirk throughout: a transfer released while it moves still lands
`LATE_S` later unless an end is dead or silenced by then.

Search (`kvfsm.cli.check._search`): breadth first, stateless with replay: a state is its
action sequence, replayed on a fresh deterministic cluster (deep copies are unsafe: engines hold
closures over their cluster), in this process or in worker processes. Every replay is checked
(ledger, conformance); a path ends when nothing is enabled or at `max_depth`, and then gets the
stateful suite's end-of-run checks (every prefill finished, time run until quiet, quiescence,
shut down, again). The first trace of each distinct problem is a shortest one.

States are deduplicated by a fingerprint (`kvfsm.cli.check._state`: what it keeps and what
it leaves out).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import msgspec

from kvfsm.cli.check._state import (
    Namer,
    agent_of,
    flight_of,
    handshakes,
    is_late_bytes,
    message_print,
    pending_events,
    questions,
)
from kvfsm.core import Drain, Mode, Step
from kvfsm.fabric import SimFaults
from kvfsm.sim import FAST_CONFIG, Cluster

__all__ = ["DELAY_S", "LATE_S", "MAX_DEPTH", "CheckReport", "CheckViolation"]

MAX_DEPTH = 9
"""Actions per path at most by default (a path cut here still gets the end-of-run checks): both
modes, 2 requests and 2 faults explore in minutes on two cores as two workers: CI's bound
(`make check`; `make test`'s pytest explores a shallower one, docs/testing.md)."""
DELAY_S = 2.5
"""The delay fault: past the stall bound, the lease, the watchdog and P's stall bound."""
LATE_S = 0.5
"""A transfer released while it moves still lands this much later (UCX over TCP), unless an end
is dead or cut then: so D holds the blocks of such a request this long before handing them back."""
_FABRIC = SimFaults(transfer_latency=0.25, late_delivery=LATE_S)
_BLOCKS = (2, 1)  # P blocks of r1, r2
_AGENTS = ("P#0", "D#0")
_C = FAST_CONFIG
_SETTLE_S = 4 * (_C.lease_s + _C.watchdog_s + _C.producer_stall_s + _C.fence_s + LATE_S)
_END = "end of run: finish every prefill, let time run, shut down"

Action = tuple[str, ...]
Path = tuple[Action, ...]


class CheckViolation(msgspec.Struct):
    """A safety problem and a shortest action sequence that reaches it."""

    trace: list[str]
    problems: list[str]


class CheckReport(msgspec.Struct):
    """What one exploration covered and found."""

    mode: str
    max_faults: int
    requests: int
    depth_bound: int
    states_explored: int = 0
    transitions: int = 0
    paths: int = 0  # paths ended (nothing enabled, or the depth bound) and checked at their end
    paths_cut: int = 0  # of which the depth bound ended
    max_depth: int = 0
    elapsed_s: float = 0.0
    violating_transitions: int = 0
    model_transitions_taken: int = 0  # distinct (lifecycle, source, event, dest) of models/
    model_transitions: int = 0  # in the models this mode runs
    violations: list[CheckViolation] = msgspec.field(default_factory=list)


class _Run:
    """One path replayed on a fresh cluster."""

    def __init__(self, mode: Mode, answers: dict[Any, Any], taken: set[Any]) -> None:
        self.cluster = c = Cluster(mode, faults=_FABRIC, config=_C, num_blocks=8, trace=False)
        if (conformance := c.conformance) is not None:
            conformance.share_answers(answers)

            def record(step: Step) -> None:
                taken.add((step.lifecycle, step.source, step.event, step.dest))
                conformance.record(step)

            for engine in c.engines.values():
                engine.side.set_recorder(record)
        self.poster = "P#0" if mode == "push" else "D#0"
        self.faults = 0
        self.spent: set[Action] = set()
        self.labels: list[str] = []
        self.labelled = False

    def apply(self, action: Action) -> None:
        """Run one action and record a readable label of it."""
        c, kind = self.cluster, action[0]
        label = " ".join(action)
        if kind == "admit":
            c.admit(action[1], _BLOCKS[int(action[1][1:]) - 1], d_first=action[2] == "D")
            label = f"admit {action[1]} ({action[2]} first)"
        elif kind == "prefill":
            c.finish_prefill(action[1])
        elif kind == "abort":
            c.abort(action[1], action[2])
            label = f"abort {action[1]} on {action[2]}"
            self.spent.add(action)
        elif kind == "drain":
            c.engines[action[1]].submit(Drain())
            c.collect()
            label = f"drain {action[1]}"
            self.spent.add(action)
        elif kind == "advance":
            label = _advance(c, self.labelled)
        else:
            self.faults += 1
            label = _inject(c, action)
        self.labels.append(label)

    def enabled(self, max_faults: int, requests: int) -> list[Action]:
        """Every action worth trying here (none: the path is over)."""
        c = self.cluster
        pending = [f"r{i + 1}" for i in range(requests) if f"r{i + 1}" not in c.requests]
        draining = ("drain", "P#0") in self.spent  # P admits nothing more (as the connector)
        acts: list[Action] = []
        if pending and not draining:
            acts += [("admit", pending[0], s) for s in ("P", "D")]
        for key, pr in sorted(c.requests.items()):
            if not pr.finished_prefill and _holds(c, "P#0", pr.p_id):
                acts.append(("prefill", key))
            for side, agent, rid in (("P", "P#0", pr.p_id), ("D", "D#0", pr.d_id)):
                if ("abort", key, side) not in self.spent and _holds(c, agent, rid):
                    acts.append(("abort", key, side))
        if not draining and "P#0" not in c.dead:
            acts.append(("drain", "P#0"))
        if c.next_due() is not None:
            acts.append(("advance",))
        if self.faults < max_faults and (pending or not c.quiet()):
            acts += self._faults()
        return acts

    def _faults(self) -> list[Action]:
        c, net = self.cluster, self.cluster.network
        acts: list[Action] = []
        for _, seq, ev in pending_events(c):
            if is_late_bytes(ev):
                continue  # lands unless an end dies or is cut: the kill faults cover that
            if hasattr(ev, "msg"):
                acts += [("drop", str(seq)), ("duplicate", str(seq)), ("delay", str(seq))]
            elif flight_of(c, ev) is not None:
                acts += [("err", str(seq)), ("stuck", str(seq))]
        armed = dict(net.snapshot().scripted_posts).get(self.poster)
        if self.poster not in c.dead and not armed and _may_post(c, self.poster):
            acts.append(("fail_post", self.poster))
        for agent in (a for a in _AGENTS if a not in c.dead):
            acts += [("kill", agent, "reset"), ("kill", agent, "cut")]
            shaking = any(e[1] == agent for x in c.live_engines() for e in handshakes(x))
            shaking |= any(q.agent == agent for x in c.live_engines() for _, q in questions(x))
            if shaking and agent not in dict(c.directory.snapshot().failing):
                acts.append(("handshake", agent))
        return acts


def _advance(c: Cluster, labelled: bool = False) -> str:
    """Move the clock to the next due thing and let every engine poll; returns a label (if
    `labelled`: replays for the search need none)."""
    due = c.next_due()
    assert due is not None
    due = max(due, c.now)
    events = pending_events(c)
    if not labelled:
        what = ""
    elif events and events[0][0] == due:
        what = _describe(c, events[0][2], due)
    else:
        shakes = [
            f"{e.agent}'s handshake with {h[1]}"
            for e in c.live_engines()
            for h in handshakes(e)
            if h[0] == due
        ] + [
            f"{e.agent}'s question to {q.agent}"
            for e in c.live_engines()
            for at, q in questions(e)
            if at == due
        ]
        woken = [e.agent for e in c.live_engines() if e.next_wakeup() == due]
        what = ", ".join(shakes) or f"a wakeup of {' and '.join(woken)}"
    label = f"advance {due - c.now:.4f} s to t={due:.4f}: {what}"
    c.network.advance_to(due)
    c.step(0.0)
    return label


def _inject(c: Cluster, action: Action) -> str:
    """Inject one fault, at once; returns its label."""
    kind, net = action[0], c.network
    if kind == "fail_post":
        net.inject_next_post(action[1], "fail_post")
        return f"fault: the next post of {action[1]} fails"
    if kind == "kill":
        c.kill(action[1], reset=action[2] == "reset")
        return f"fault: {'kill' if action[2] == 'reset' else 'silence'} {action[1]}"
    if kind == "handshake":
        c.directory.fail_next(action[1])
        return f"fault: the side channel's next exchange with {action[1]} fails"
    seq = int(action[1])
    when, ev = next((w, e) for w, s, e in net.snapshot().events if s == seq)
    ev = cast(Any, ev)  # a message, a completion or late bytes: told apart by their fields
    label = f"fault: {kind} {_describe(c, ev, when)}"
    if kind in ("drop", "delay", "stuck"):
        net.withdraw_event(seq)
    if kind == "delay":
        net.add_event(when + DELAY_S, ev)
        label += f" by {DELAY_S} s"
    elif kind == "duplicate":
        net.add_event(when, dataclasses.replace(ev))
    elif kind == "err":
        ev.fail_rows = 0  # it ends ERR when due, having copied nothing
    return label


def _describe(c: Cluster, ev: Any, when: float) -> str:
    n = Namer(c)
    if is_late_bytes(ev):
        into = ev.xfer.peer if ev.xfer.op == "WRITE" else agent_of(c, ev.gen)
        return f"late bytes of a released {ev.xfer.op} into {into} (due t={when:.4f})"
    if not hasattr(ev, "msg"):
        flight = flight_of(c, ev)
        what = "a stale transfer" if flight is None else f"the {flight.op} of {flight.request_id}"
        return f"{n.id(what)} (due t={when:.4f})"
    msg = message_print(ev.msg, n)
    to = agent_of(c, ev.receiver_gen)
    return f"{msg[0]} of {msg[1] or msg[2]} {ev.sender} -> {to} (due t={when:.4f})"


def _may_post(c: Cluster, agent: str) -> bool:
    """Whether some request `agent` holds has not posted its transfer yet."""
    return any(
        not r.links or any(not link.transfer_id for link in r.links.values())
        for r in c.engines[agent].side.requests.values()
    )


def _holds(c: Cluster, agent: str, request_id: str) -> bool:
    return agent not in c.dead and request_id in c.engines[agent].side.requests


def _end_of_run(c: Cluster) -> list[str]:
    """The stateful suite's teardown: every prefill finished, time run, shut down, all checked."""
    for key in sorted(c.requests):
        c.finish_prefill(key)
    end = c.now + _SETTLE_S
    while not c.quiet() and (due := c.next_due()) is not None and due <= end:
        _advance(c)
    problems = c.ledger.quiescence() + _conformance(c)
    if not problems:
        c.shutdown()
        problems = c.ledger.quiescence() + _conformance(c)
    return problems


def _conformance(c: Cluster) -> list[str]:
    return list(c.conformance.violations) if c.conformance is not None else []
