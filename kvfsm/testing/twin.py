"""The stateful programs on both fabrics at once: every rule runs on a simulated cluster and on real
NIXL agents with the real ZMQ side channel (`LockstepCluster`), on one clock, each brought to
rest before the next rule. After every step both keep the safety properties and conformance and
their requests stand in the same states; at the end both are quiescent and agree on every final
state, on what vLLM was told of each request, and on D's bytes."""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import hypothesis.strategies as st
import msgspec
import numpy as np
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfsm.core import CoreConfig, Mode, ReleaseBlocks, ReportFailed, ReportReceived
from kvfsm.fabric import SimFaults, tcp_late_delivery_s
from kvfsm.sim import FAST_CONFIG, SMALL_GEOMETRY, Cluster, LockstepCluster
from kvfsm.wire import SharedSecret

__all__ = ["TwinMachine", "twin_for"]

_STEPS = (0.0, 1e-3, 0.01, 0.2, 0.6, 1.5, 3.5)  # from one instant to past every deadline
_HANDSHAKE_FAULTS = ("refuse", "hang")
_INSTANT = 1e-6  # a simulated message takes 1e-9 s: what falls within this is "now"
_TOLD = (ReportReceived, ReportFailed, ReleaseBlocks)


def _config() -> CoreConfig:
    """Short deadlines; D holds given-up blocks as long as UCX over TCP may still deliver into
    them, on both fabrics, so both hand blocks back at the same instant. No questions over the
    side channel (`status_query_s=0`): a real side channel answers in real time, the virtual
    clock cannot hold it in step; the scenarios and `kvfsm check` cover them."""
    return msgspec.structs.replace(
        FAST_CONFIG, transport_drain_s=tcp_late_delivery_s(), status_query_s=0.0
    )


class TwinMachine(RuleBasedStateMachine):
    """P and D on `SimFabric` and on real NIXL, driven by the same rules step by step."""

    mode: ClassVar[Mode] = "push"
    p_tp: ClassVar[int] = 1
    d_tp: ClassVar[int] = 1
    d_block_size: ClassVar[int | None] = None
    secret: ClassVar[SharedSecret | None] = None
    programs: ClassVar[int] = 0  # over every twin machine, for the report
    steps: ClassVar[int] = 0
    taken: ClassVar[Counter[str]] = Counter()  # faults injected, and requests' final states

    def __init__(self) -> None:
        super().__init__()
        options: dict[str, Any] = {
            "p_tp": self.p_tp,
            "d_tp": self.d_tp,
            "num_blocks": 16,
            "config": _config(),
            "geometry": SMALL_GEOMETRY,
            "d_block_size": self.d_block_size,
            "secret": self.secret,
        }
        self.sim = Cluster(
            self.mode, faults=SimFaults(notif_latency=1e-9), handshake_latency=0.0, **options
        )
        self.told: dict[str, list[tuple[str, str, str, int]]] = {"sim": [], "real": []}
        self._listen(self.sim, "sim")
        self.real = LockstepCluster(self.mode, clock=lambda: self.sim.now, **options)
        self._listen(self.real, "real")
        self.count = 0
        self.agents = self.sim.agents("P") + self.sim.agents("D")
        TwinMachine.programs += 1

    def _listen(self, cluster: Cluster, name: str) -> None:
        """Record what the caller (vLLM) is told of each request, in order."""
        told = self.told[name]

        def record(agent: str, out: Any) -> None:
            pr = cluster.ledger.request_of(agent, getattr(out, "request_id", ""))
            if pr is not None and isinstance(out, _TOLD):
                told.append((pr.key, agent, type(out).__name__, len(out.blocks)))

        cluster.output_listeners.append(record)

    # --- rules -------------------------------------------------------------------------------

    @rule(n=st.integers(0, 3), cached=st.integers(0, 3), d_first=st.booleans())
    def admit(self, n: int, cached: int, d_first: bool) -> None:
        """A request arrives at both engines, D maybe holding a prefix of it."""
        if self.sim.can_admit(n) and self.real.can_admit(n):
            self.count += 1
            for c in (self.sim, self.real):
                c.admit(f"r{self.count}", n, min(cached, n), d_first)
        self._rest()

    @precondition(lambda self: self._prefilling())
    @rule(data=st.data(), without_blocks=st.sampled_from([False] * 5 + [True]))
    def finish_prefill(self, data: st.DataObject, without_blocks: bool) -> None:
        """P's prefill of some request finishes (rarely with no KV)."""
        self.finish_prefill_of(data.draw(st.sampled_from(self._prefilling())), without_blocks)

    def finish_prefill_of(self, key: str, without_blocks: bool = False) -> None:
        """P's prefill of `key` finishes on both."""
        for c in (self.sim, self.real):
            c.finish_prefill(key, without_blocks)
        self._rest()

    @precondition(lambda self: self.sim.requests)
    @rule(data=st.data(), side=st.sampled_from(["P", "D"]))
    def abort(self, data: st.DataObject, side: str) -> None:
        """One side's serving engine aborts some request, in whatever state it is."""
        key = data.draw(st.sampled_from(sorted(self.sim.requests)))
        for c in (self.sim, self.real):
            c.abort(key, side)
        self._rest()

    @rule(dt=st.sampled_from(_STEPS))
    def advance(self, dt: float) -> None:
        """Time passes on the one clock."""
        self.sim.step(dt)
        self._rest()

    @precondition(lambda self: self._live())
    @rule(data=st.data(), kind=st.sampled_from(_HANDSHAKE_FAULTS))
    def handshake_fault(self, data: st.DataObject, kind: str) -> None:
        """The next handshake with a live rank is refused, or answers 0.5 or 5 s later."""
        agent = data.draw(st.sampled_from(self._live()))
        TwinMachine.taken[kind] += 1
        if kind == "refuse":
            self.sim.directory.fail_next(agent)
            self.real.refuse_next_handshake(agent)
        else:
            seconds = data.draw(st.sampled_from([0.5, 5.0]))
            self.sim.directory.hang_next(agent, seconds=seconds)
            self.real.hang_next_handshake(agent, seconds)

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def post_fault(self, data: st.DataObject) -> None:
        """A live rank's next post is refused."""
        agent = data.draw(st.sampled_from(self._live()))
        TwinMachine.taken["post"] += 1
        self.sim.network.inject_next_post(agent, "fail_post")
        self.real.refuse_next_post(agent)

    @precondition(lambda self: len(self._live()) > 1)
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        """A rank dies; its peers hear nothing more from it."""
        agent = data.draw(st.sampled_from(self._live()))
        TwinMachine.taken["kill"] += 1
        self.sim.kill(agent, reset=False)
        self.real.kill(agent)
        self._rest()

    def _prefilling(self) -> list[str]:
        return [k for k, pr in sorted(self.sim.requests.items()) if not pr.finished_prefill]

    def _live(self) -> list[str]:
        return [a for a in self.agents if a not in self.sim.dead]

    def _rest(self) -> None:
        """Bring the simulated cluster to rest at this instant, then the real one."""
        TwinMachine.steps += 1
        for _ in range(100_000):
            due = self.sim.next_due()
            if due is None or due > self.sim.now + _INSTANT:
                break
            self.sim.step(max(0.0, due - self.sim.now))
        self.real.catch_up()

    # --- properties --------------------------------------------------------------------------

    @invariant()
    def safe_and_alike(self) -> None:
        """Both keep every safety property and conformance, and stand in the same states."""
        for c in (self.sim, self.real):
            problems = c.ledger.violations + (c.conformance.violations if c.conformance else [])
            assert not problems, "\n".join(problems[:10])
        _alike("states", _states(self.sim), _states(self.real))

    def teardown(self) -> None:
        """Every prefill over, time past every bound: both quiescent, and alike to the byte."""
        try:
            for key in sorted(self.sim.requests):
                for c in (self.sim, self.real):
                    c.finish_prefill(key)
            self._rest()
            while not (self.sim.quiet() and self.real.quiet()) and self.sim.now < 600.0:
                self.advance(0.25)
            for c in (self.sim, self.real):
                assert not c.ledger.quiescence(), c.ledger.quiescence()
            _alike("final states", _finals(self.sim), _finals(self.real))
            TwinMachine.taken.update(
                f"{agent[0]} {state}"
                for f in _finals(self.real).values()
                for agent, state in f.items()
            )
            _alike(
                "what the caller was told",
                _per_request(self.told["sim"]),
                _per_request(self.told["real"]),
            )
            _alike("D's bytes", _received(self.sim), _received(self.real))
        finally:
            self.real.close()


def _alike(what: str, sim: Any, real: Any) -> None:
    if sim != real:
        raise AssertionError(f"{what} differ:\n  sim:  {sim!r:.2000}\n  real: {real!r:.2000}")


def _per_request(told: list[tuple[str, str, str, int]]) -> dict[str, list[tuple[str, ...]]]:
    """Each request's reports to the caller in order, per rank (the order across requests that
    end at one instant is the fabric's)."""
    out: dict[str, list[tuple[str, ...]]] = {}
    for key, agent, kind, blocks in told:
        out.setdefault(key, []).append((agent, kind, str(blocks)))
    return {k: sorted(v, key=lambda t: t[0]) for k, v in sorted(out.items())}


def _states(c: Cluster) -> dict[str, dict[str, str]]:
    """Each request's state on every live rank (terminal once it ended)."""
    out: dict[str, dict[str, str]] = {}
    for key, pr in c.requests.items():
        states = dict(pr.final)
        for agent, engine in c.engines.items():
            req = engine.side.requests.get(pr.p_id if agent[0] == "P" else pr.d_id)
            if agent not in c.dead and req is not None:
                states[agent] = req.state
        out[key] = dict(sorted(states.items()))
    return out


def _finals(c: Cluster) -> dict[str, dict[str, str]]:
    return {k: dict(sorted(pr.final.items())) for k, pr in c.requests.items()}


def _received(c: Cluster) -> dict[str, bytes]:
    """What every live D rank holds in the blocks of each request it received."""
    out = {}
    for key, pr in c.requests.items():
        for agent in c.agents("D"):
            if pr.final.get(agent) == "done" and len(pr.d_blocks) and agent not in c.dead:
                kv = c.engines[agent].kv
                g = kv.geometry
                rows = [r.reshape(g.num_blocks, g.block_len)[pr.d_blocks] for r in kv.regions()]
                out[f"{key}@{agent}"] = np.concatenate(rows).tobytes()
    return out


def twin_for(
    mode: Mode,
    p_tp: int = 1,
    d_tp: int = 1,
    d_block_size: int | None = None,
    secret: SharedSecret | None = None,
) -> type:
    """A `TwinMachine` for one mode, TP pair, D block size and shared secret (the real side
    channel and every notification on both fabrics authenticated with it)."""
    name = f"TwinMachine_{mode}_{p_tp}x{d_tp}" + (f"_d{d_block_size}" if d_block_size else "")
    name += "_sealed" if secret else ""
    attrs = {
        "mode": mode,
        "p_tp": p_tp,
        "d_tp": d_tp,
        "d_block_size": d_block_size,
        "secret": secret,
    }
    return type(name, (TwinMachine,), attrs)
