"""Run a scenario file on a P/D cluster, simulated or over real NIXL, and report what happened.

The run is the stateful suite's, scripted: a `Cluster` with the safety ledger and the model
conformance check on, driven through the file's timeline. After the timeline every unfinished
prefill finishes (the serving engine's part, as in the stateful suite's teardown) and time runs
past every bound; then the six properties are checked at quiescence and the file's expected final
states compared. The report has every request's merged trace (each rank's transitions on one
clock), its final state per rank, the broken invariants and the unmet expectations.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from kvfsm.cli.scenario._file import (
    AbortStep,
    AdmitStep,
    AdvanceStep,
    ExpectStep,
    FaultStep,
    FinishStep,
    Scenario,
    ScenarioError,
    Step,
    UntilStep,
    core_config,
)
from kvfsm.core import Finished
from kvfsm.fabric import SimFaults
from kvfsm.sim import SMALL_GEOMETRY, SMALL_MLA_GEOMETRY, Cluster

__all__ = ["RequestOutcome", "ScenarioReport", "TraceEntry", "run_scenario"]

_UNTIL_STEP_S = 1e-3
_MIN_STEP_S = 1e-6  # something due now is handled by this step's poll; then time moves on


class TraceEntry(msgspec.Struct, frozen=True):
    """One transition of a request on one rank: when, where, the event and the state entered."""

    t: float
    agent: str
    event: str
    state: str


class RequestOutcome(msgspec.Struct, kw_only=True):
    """One request of the scenario: its ids on each side, final state per rank, merged trace."""

    ids: dict[str, str]
    final_state: dict[str, str]
    """Agent -> terminal state ("live: <state>" if it never ended: a broken property)."""
    trace: list[TraceEntry]


class ScenarioReport(msgspec.Struct, kw_only=True):
    """What one run of a scenario did; `passed` when nothing broke and every expectation held."""

    name: str
    description: str
    reference: str
    mode: str
    fabric: str
    requests: dict[str, RequestOutcome]
    violations: list[str]
    """Broken safety properties (see docs/testing.md), at any step or at quiescence."""
    unmet: list[str]
    """Expectations of the file that did not hold."""
    counters: dict[str, dict[str, int]]
    """Per agent: the errors its core counted (malformed, late, unknown messages, ...)."""
    elapsed_s: float
    """Clock time the run covered (simulated, or real on the real fabric)."""
    passed: bool
    """No violation and no unmet expectation."""


def run_scenario(scenario: Scenario, fabric: Literal["sim", "nixl"] = "sim") -> ScenarioReport:
    """Run `scenario` on `fabric`; `ScenarioError` if it cannot run there."""
    if fabric not in scenario.fabrics:
        raise ScenarioError(f"{scenario.name}: declares fabrics {scenario.fabrics}, not {fabric!r}")
    run = _Run(scenario, fabric)
    try:
        run.timeline()
        run.finish()
    except Exception as exc:  # a core that raises (its own protocol error) is a finding too
        run.crash = f"the run raised {type(exc).__name__}: {exc}"
    finally:
        run.cluster.close()
    return run.report()


class _Run:
    def __init__(self, scenario: Scenario, fabric: Literal["sim", "nixl"]) -> None:
        self.s = scenario
        self.fabric = fabric
        p, d = scenario.engine("P"), scenario.engine("D")
        geometry = msgspec.structs.replace(
            SMALL_MLA_GEOMETRY if p.mla else SMALL_GEOMETRY, block_size=p.block_size
        )
        try:
            self.cluster = Cluster(
                scenario.mode,
                seed=scenario.seed,
                faults=SimFaults(**scenario.network),
                config=core_config(scenario),
                num_blocks=p.num_blocks,
                geometry=geometry,
                d_block_size=d.block_size,
                p_tp=p.tp,
                d_tp=d.tp,
                fabric=fabric,
                clock_skew={"P": p.clock_skew, "D": d.clock_skew},
            )
        except ValueError as exc:  # a geometry the engines cannot run (TP not splitting heads)
            raise ScenarioError(f"{scenario.name}: engines: {exc}") from None
        self.finished: dict[tuple[str, str], Finished] = {}
        self.cluster.on_finished = lambda agent, out: self._on_finished(agent, out)
        self.unmet: list[str] = []
        self.crash = ""
        self.start = self.cluster.now
        self._lost: dict[str, set[str]] = {}  # agent -> requests admitted before it died

    def _on_finished(self, agent: str, out: Finished) -> None:
        self.finished[(agent, out.request_id)] = out

    # --- the timeline ----------------------------------------------------------------------------

    def timeline(self) -> None:
        specs = {r.id: r for r in self.s.requests}
        for i, step in enumerate(self.s.timeline):
            request = getattr(step, "request", None)
            admitted = request in self.cluster.requests
            if isinstance(step, AdmitStep) and admitted:
                self.unmet.append(f"timeline[{i}]: {request!r} admitted twice")
            elif isinstance(step, AdmitStep):
                spec = specs[step.request]
                # `cached` counts P blocks; D's prefix-cache hit is the whole D blocks they fill
                cached = min(spec.cached, spec.blocks) // self.cluster.block_ratio
                self.cluster.admit(spec.id, spec.blocks, cached, step.d_first, spec.same_id)
            elif request is not None and not admitted:
                self.unmet.append(f"timeline[{i}]: {request!r} is not admitted yet")
            elif not self._step(i, step):
                return  # an `until` that never came: what follows assumed it

    def _step(self, i: int, step: Step) -> bool:
        c = self.cluster
        if isinstance(step, FinishStep):
            c.finish_prefill(step.request, step.without_blocks)
        elif isinstance(step, AbortStep):
            c.abort(step.request, step.side)
        elif isinstance(step, AdvanceStep):
            self._advance(step.seconds)
        elif isinstance(step, FaultStep):
            self._fault(step)
        elif isinstance(step, ExpectStep):
            self._expect(f"timeline[{i}]", step.request, step.agent, step.state)
        elif isinstance(step, UntilStep):
            return self._until(i, step)
        return True

    def _advance(self, seconds: float) -> None:
        """Time passes and every engine polls whenever something falls due on it (a deadline,
        a heartbeat, a delivery), as `EngineLoop` makes it: the engines are not frozen."""
        c = self.cluster
        end = c.now + seconds
        if not c.real:
            while c.now < end:
                due = c.next_due()
                c.step(min(max(end if due is None else due, c.now + _MIN_STEP_S), end) - c.now)
            return
        while (left := end - c.now) > 0:
            c.step(0.0)
            time.sleep(min(left, _UNTIL_STEP_S))  # real time must pass; the engines poll between

    def _until(self, i: int, step: UntilStep) -> bool:
        wanted = _states(step.state)
        end = self.cluster.now + step.within
        while (state := self.state(step.request, step.agent)) not in wanted:
            if self.cluster.now >= end:
                self.unmet.append(
                    f"timeline[{i}]: {step.request} on {step.agent} never reached"
                    f" {'/'.join(wanted)} within {step.within:g}s (it is {state})"
                )
                return False
            self._advance(_UNTIL_STEP_S)
        return True

    def _fault(self, step: FaultStep) -> None:
        c, net, agent = self.cluster, self.cluster.network, step.agent
        kind = step.kind
        if kind in ("fail_post", "err", "stuck", "lag"):
            net.inject_next_post(agent, "delay" if kind == "lag" else kind)
        elif kind in ("drop", "duplicate"):
            (net.drop_next_notif if kind == "drop" else net.duplicate_next_notif)(agent)
        elif kind == "delay":
            net.delay_next_notif(agent, step.seconds)
        elif kind == "hold":
            net.hold_notifs(agent)
        elif kind in ("release", "reorder"):
            net.release_held(agent, reverse=kind == "reorder")
        elif kind in ("kill", "cut"):
            self._lost.setdefault(agent, set()).update(c.requests)
            c.kill(agent, reset=kind == "kill")
        elif kind == "revive":
            c.revive(agent)
        elif kind == "handshake_fail":
            c.directory.fail_next(agent)
        elif kind == "handshake_hang":
            c.directory.hang_next(agent, seconds=step.seconds)
        elif kind == "lose":
            c.lose_notification(agent, step.message)
        elif kind == "outage":
            c.notification_outage(agent, step.seconds)
        elif kind in ("side_channel_cut", "side_channel_restore"):
            c.cut_side_channel(agent, kind == "side_channel_cut")
        else:
            c.inject_garbage(agent, step.payload.encode())

    # --- states and expectations -----------------------------------------------------------------

    def _id(self, key: str, agent: str) -> str:
        pr = self.cluster.requests[key]
        return pr.p_id if agent.startswith("P") else pr.d_id

    def state(self, key: str, agent: str) -> str:
        """The request's state on `agent` now: its core state, its terminal state once it
        ended, "dead" if the rank's process died with it (a revived rank never knew it),
        "absent" if it never reached the rank."""
        if key not in self.cluster.requests:
            return "absent"
        rid = self._id(key, agent)
        if agent in self.cluster.dead:
            return "dead"
        req = self.cluster.engines[agent].side.requests.get(rid)
        if req is not None:
            return req.state
        done = self.finished.get((agent, rid))
        if done is not None:
            return done.state
        return "dead" if key in self._lost.get(agent, ()) else "absent"

    def _expect(self, where: str, key: str, agent: str, states: str | list[str]) -> None:
        wanted = _states(states)
        state = self.state(key, agent)
        if state not in wanted:
            self.unmet.append(f"{where}: {key} on {agent} is {state}, expected {'/'.join(wanted)}")

    def finish(self) -> None:
        """The serving engine finishes every prefill; time runs past every bound; the end
        states are checked against the file."""
        for key in sorted(self.cluster.requests):
            self.cluster.finish_prefill(key)
        self.cluster.settle()
        for i, outcome in enumerate(self.s.expect):
            side = outcome.side
            agents = [outcome.agent] if outcome.agent else self.cluster.agents(side or "P")
            for agent in agents:
                self._expect(f"expect[{i}]", outcome.request, agent, outcome.state)

    # --- the report ------------------------------------------------------------------------------

    def report(self) -> ScenarioReport:
        c = self.cluster
        found = c.ledger.quiescence() + (c.conformance.violations if c.conformance else [])
        found += [self.crash] if self.crash else []
        counters = {
            agent: {kind: n for kind, n in sorted(engine.side.counters.items()) if n}
            for agent, engine in c.engines.items()
            if any(engine.side.counters.values())
        }
        s, violations = self.s, list(dict.fromkeys(found))
        return ScenarioReport(
            name=s.name,
            description=s.description,
            reference=s.reference,
            mode=s.mode,
            fabric=self.fabric,
            requests={k: self._outcome(k) for k in sorted(c.requests)},
            violations=violations,
            unmet=self.unmet,
            counters=counters,
            elapsed_s=round(c.now - self.start, 6),
            passed=not violations and not self.unmet,
        )

    def _outcome(self, key: str) -> RequestOutcome:
        pr = self.cluster.requests[key]
        final, trace = {}, []
        for agent in self.cluster.agents("P") + self.cluster.agents("D"):
            rid = self._id(key, agent)
            done = self.finished.get((agent, rid))
            live = self.cluster.engines[agent].side.requests.get(rid)
            if done is not None:
                final[agent], history = done.state, done.history
            elif agent in self.cluster.dead:
                final[agent], history = "dead", ()
            elif live is not None:
                final[agent], history = f"live: {live.state}", live.transitions()
            else:
                final[agent], history = self.state(key, agent), ()
            t0 = self.start + self.cluster.clock_skew[agent[0]]  # one clock for every rank
            trace += [TraceEntry(round(t - t0, 6), agent, e, st) for e, st, t in history]
        trace.sort(key=lambda entry: entry.t)
        return RequestOutcome(ids={"P": pr.p_id, "D": pr.d_id}, final_state=final, trace=trace)


def _states(states: str | list[str]) -> list[str]:
    return [states] if isinstance(states, str) else list(states)
