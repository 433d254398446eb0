"""The hypothesis state machine over a simulated P/D cluster: every event and fault as a rule, the six
safety properties checked after every step, quiescence checked at the end of every example."""

from __future__ import annotations

from typing import ClassVar

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfsm.core import Mode
from kvfsm.fabric import SimFaults
from kvfsm.layout import KvGeometry
from kvfsm.sim import SMALL_GEOMETRY, Cluster
from kvfsm.wire import SharedSecret

__all__ = ["LifecycleMachine", "machine_for"]

# From notification latency to past every deadline, weighted towards the short steps in which
# messages interleave.
_STEPS = (0.0, 1e-4, 1e-3, 1e-3, 0.01, 0.05, 0.05, 0.2, 0.6, 1.5, 3.5)
_POST_FAULTS = ("fail_post", "err", "stuck", "delay")
_FAULTS = (
    *_POST_FAULTS,
    "drop",
    "duplicate",
    "delay_notif",
    "hold",
    "release",
    "reorder",
    "handshake",
    "hang",
)


class LifecycleMachine(RuleBasedStateMachine):
    """P and D engines on `SimFabric` driven through admits, prefills, aborts, time and faults."""

    mode: ClassVar[Mode] = "push"
    p_tp: ClassVar[int] = 1
    d_tp: ClassVar[int] = 1
    faults: ClassVar[SimFaults | None] = None
    geometry: ClassVar[KvGeometry] = SMALL_GEOMETRY
    d_block_size: ClassVar[int | None] = None
    clock_skew: ClassVar[dict[str, float] | None] = None
    secret: ClassVar[SharedSecret | None] = None
    examples_run: ClassVar[int] = 0  # over every machine, for the coverage check

    def __init__(self) -> None:
        super().__init__()
        self.cluster = Cluster(
            self.mode,
            p_tp=self.p_tp,
            d_tp=self.d_tp,
            faults=self.faults,
            num_blocks=24,
            geometry=self.geometry,
            d_block_size=self.d_block_size,
            clock_skew=self.clock_skew,
            secret=self.secret,
        )
        self.count = 0
        self.agents = self.cluster.agents("P") + self.cluster.agents("D")

    # --- requests --------------------------------------------------------------------------------

    @rule(
        n=st.integers(0, 4),
        cached=st.integers(0, 4),
        d_first=st.booleans(),
        same_id=st.booleans(),
    )
    def admit(self, n: int, cached: int, d_first: bool, same_id: bool) -> None:
        """A request arrives at both engines (D first or P first), D maybe holding a prefix."""
        if self.cluster.can_admit(n):
            self.count += 1
            self.cluster.admit(f"r{self.count}", n, min(cached, n), d_first, same_id)

    @precondition(lambda self: self._prefilling())
    @rule(data=st.data(), without_blocks=st.sampled_from([False] * 7 + [True]))
    def finish_prefill(self, data: st.DataObject, without_blocks: bool) -> None:
        """P's prefill of some request finishes (rarely leaving P with no KV for it)."""
        self.cluster.finish_prefill(data.draw(st.sampled_from(self._prefilling())), without_blocks)

    @precondition(lambda self: self._active("P") or self._active("D"))
    @rule(data=st.data(), side=st.sampled_from(["P", "D"]))
    def abort(self, data: st.DataObject, side: str) -> None:
        """The serving engine of one side aborts some request it still works on, in any state."""
        keys = self._active(side) or sorted(self.cluster.requests)
        self.cluster.abort(data.draw(st.sampled_from(keys)), side)

    def _prefilling(self) -> list[str]:
        return [k for k, pr in sorted(self.cluster.requests.items()) if not pr.finished_prefill]

    def _active(self, side: str) -> list[str]:
        """Requests still live on some engine of `side`."""
        live = [e.side.requests for e in self.cluster.live(side)]
        attr = "p_id" if side == "P" else "d_id"
        return [
            k
            for k, pr in sorted(self.cluster.requests.items())
            if any(getattr(pr, attr) in reqs for reqs in live)
        ]

    @rule(dt=st.sampled_from(_STEPS))
    def advance(self, dt: float) -> None:
        """Time passes; every engine polls."""
        self.cluster.step(dt)

    # --- faults ----------------------------------------------------------------------------------

    @precondition(lambda self: len(self.cluster.dead) < len(self.agents))
    @rule(data=st.data(), kind=st.sampled_from(_FAULTS))
    def fault(self, data: st.DataObject, kind: str) -> None:
        """One fault aimed at a live agent: its next notification dropped, duplicated or delayed,
        its notifications held or released (possibly reversed), its next post failing, ending in
        ERR, hanging or lagging, or its next handshake failing or hanging."""
        agent = self._live_agent(data)
        net = self.cluster.network
        if kind in _POST_FAULTS:
            net.inject_next_post(agent, kind)  # type: ignore[arg-type]
        elif kind == "drop":
            net.drop_next_notif(agent)
        elif kind == "duplicate":
            net.duplicate_next_notif(agent)
        elif kind == "delay_notif":
            net.delay_next_notif(agent, data.draw(st.sampled_from([1e-3, 0.7, 2.5])))
        elif kind == "hold":
            net.hold_notifs(agent)
        elif kind in ("release", "reorder"):
            net.release_held(agent, reverse=kind == "reorder")
        elif kind == "hang":
            self.cluster.directory.hang_next(agent, seconds=data.draw(st.sampled_from([0.5, 5.0])))
        else:
            self.cluster.directory.fail_next(agent)

    @rule(data=st.data(), action=st.sampled_from(["kill", "cut", "revive"]))
    def peer_fault(self, data: st.DataObject, action: str) -> None:
        """An engine dies (its host resetting connections), goes silent, or is replaced."""
        if action == "revive":
            if self.cluster.dead:
                self.cluster.revive(data.draw(st.sampled_from(sorted(self.cluster.dead))))
        else:
            self.cluster.kill(data.draw(st.sampled_from(self.agents)), reset=action == "kill")

    @rule(data=st.data(), payload=st.binary(max_size=48))
    def garbage(self, data: st.DataObject, payload: bytes) -> None:
        """A malformed notification arrives (raw bytes, or ours with a corrupted body)."""
        agent = data.draw(st.sampled_from(self.agents))
        prefix = data.draw(st.sampled_from([b"", b"kv1", b"kv1\x85\xa1k\xa4done"]))
        self.cluster.inject_garbage(agent, prefix + payload)

    def _live_agent(self, data: st.DataObject) -> str:
        live = [a for a in self.agents if a not in self.cluster.dead]
        return data.draw(st.sampled_from(live or self.agents))

    # --- properties ------------------------------------------------------------------------------

    @invariant()
    def safe(self) -> None:
        """Properties 2-6 hold after every step."""
        problems = self.cluster.ledger.violations + self._conformance()
        assert not problems, "\n".join(problems[:10])

    @invariant()
    def only_replays_refused(self) -> None:
        """With a secret, every notification refused as a replay is one the network duplicated:
        no legitimate one is lost to the guard, however the fabric reorders or delays."""
        engines = self.cluster.engines.values()
        refused = sum(e.counters["replayed"] + e.counters["unauthenticated"] for e in engines)
        assert refused <= self.cluster.network.stats.notifs_duplicated

    def teardown(self) -> None:
        """Properties 1 and 5: once every prefill is over (the serving engine's part) and time runs
        past every bound, everything ended and was released."""
        LifecycleMachine.examples_run += 1
        for key in sorted(self.cluster.requests):
            self.cluster.finish_prefill(key)
        self.cluster.settle()
        problems = self.cluster.ledger.quiescence() + self._conformance()
        assert not problems, "\n".join(problems[:10])
        self.cluster.shutdown()
        problems = self.cluster.ledger.quiescence() + self._conformance()
        assert not problems, "\n".join(problems[:10])

    def _conformance(self) -> list[str]:
        c = self.cluster.conformance
        return c.violations if c is not None else []


def machine_for(
    mode: Mode,
    p_tp: int = 1,
    d_tp: int = 1,
    faults: SimFaults | None = None,
    *,
    geometry: KvGeometry = SMALL_GEOMETRY,
    d_block_size: int | None = None,
    clock_skew: dict[str, float] | None = None,
    secret: SharedSecret | None = None,
) -> type[LifecycleMachine]:
    """A `LifecycleMachine` subclass for one mode, TP pair, background fault mix, model geometry
    (e.g. replicated MLA KV), D block size (a multiple of the geometry's) and clock skew per
    side (hosts whose clocks differ) and shared secret (every notification sealed, checked
    and guarded against replays)."""
    name = f"LifecycleMachine_{mode}_{p_tp}x{d_tp}" + ("_mla" if geometry.mla else "")
    name += "" if geometry.kv_layout == "HND" else f"_{geometry.kv_layout}"
    name += "_interleaved" if geometry.interleaved else ""
    name += f"_d{d_block_size}" if d_block_size else ""
    name += "_skewed" if clock_skew else ""
    name += "_sealed" if secret else ""
    attrs = {
        "mode": mode,
        "p_tp": p_tp,
        "d_tp": d_tp,
        "faults": faults,
        "geometry": geometry,
        "d_block_size": d_block_size,
        "clock_skew": clock_skew,
        "secret": secret,
    }
    return type(name, (LifecycleMachine,), attrs)
