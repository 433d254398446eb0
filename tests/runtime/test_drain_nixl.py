"""Over real NIXL: a P drained mid-transfer lets the transfer finish, says goodbye, and D unloads
P's remote agent at once (not at the idle TTL); a registration after the drain is refused with
`draining` and D fails the request at once (docs/lifecycles.md, "Draining an engine")."""

from __future__ import annotations

import time
from typing import cast

import pytest

from kvfsm.core import Drain, Mode
from kvfsm.fabric import NixlFabric
from kvfsm.sim import FAST_CONFIG, Cluster
from tests.core.fixtures import admit_d_only

pytestmark = pytest.mark.nixl

_BOUND_S = 20.0  # a safety bound on the waits, not a timing assertion


def _remotes(c: Cluster, agent: str) -> int:
    return cast(NixlFabric, c.engines[agent].fabric).open_resources()["remote_agents"]


def _until(c: Cluster, done: object) -> None:
    end = time.monotonic() + _BOUND_S
    while not done() and time.monotonic() < end:  # type: ignore[operator]
        c.step(0.001)  # real NIXL: time passes on its own
    assert done(), "not reached within the safety bound"  # type: ignore[operator]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_drained_p_says_goodbye_and_d_unloads_its_agent(mode: Mode) -> None:
    c = Cluster(mode, config=FAST_CONFIG, fabric="nixl")
    try:
        assert c.serve("r1", 2) == {"P#0": "done", "D#0": "done"}
        p, d = c.engines["P#0"], c.engines["D#0"]
        assert _remotes(c, "D#0") == 1 and d.peers == 1
        pr = c.admit("r2", 4)
        c.finish_prefill("r2")
        moving = ("writing", "reading")
        _until(
            c, lambda: pr.p_id not in p.side.requests or p.side.requests[pr.p_id].state in moving
        )
        p.submit(Drain())  # the transfer under way (or just done) is not cut
        c.collect()
        _until(c, lambda: p.side.engine.state == "drained" and _remotes(c, "D#0") == 0)
        assert pr.final == {"P#0": "done", "D#0": "done"}
        assert d.side.peers["P#0"].state == "evicted" and d.side.counters["goodbyes"] == 1
        assert d.peers == 0 and d.counters["peers_removed"] >= 1
        # D did not hear in time, or asks anyway: refused at once, not at its watchdog.
        late = admit_d_only(c, "r3", 2)
        _until(c, lambda: "D#0" in late.final)
        assert late.final == {"D#0": "failed"} and p.side.counters["refused_draining"] == 1
        assert not p.side.requests and not p.inflight  # P held nothing for it
    finally:
        c.close()
