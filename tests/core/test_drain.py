"""Draining an engine (models/engine.toml): a draining P refuses new registrations with
`draining` so D fails over at once, transfers under way finish, leases no transfer started under
are cut, the engine is drained once nothing is live or held, and its peers unload its agent when
it says goodbye. On the simulated fabric; tests/runtime/test_drain_nixl.py runs real agents."""

from __future__ import annotations

import pytest

from kvfsm.core import Admit, Drain, Mode, ReportFailed, Shutdown
from kvfsm.fabric import SimFaults
from kvfsm.lifecycle import LocalProtocolError
from kvfsm.sim import Cluster
from kvfsm.wire import Failure, decode
from tests.core.fixtures import MODES, Outputs, admit_d_only, blocks, run_until, settled, warm


def _drain(cluster: Cluster, agent: str) -> None:
    cluster.engines[agent].submit(Drain())
    cluster.collect()


def _engine_state(cluster: Cluster, agent: str) -> str:
    return cluster.engines[agent].side.engine.state


@pytest.mark.parametrize("mode", MODES)
def test_a_draining_p_refuses_a_new_registration_with_draining(mode: Mode) -> None:
    cluster = Cluster(mode)
    warm(cluster)
    out = Outputs(cluster)
    sent: list[bytes] = []
    _drain(cluster, "P#0")
    assert _engine_state(cluster, "P#0") == "drained"  # nothing was live
    original = cluster.engines["P#0"]._execute

    def spy(command: object) -> None:
        payload = getattr(command, "payload", None)
        if payload is not None:
            sent.append(payload)
        original(command)  # type: ignore[arg-type]

    cluster.engines["P#0"]._execute = spy  # type: ignore[method-assign]
    pr = admit_d_only(cluster, "r", 2)
    run_until(cluster, lambda: "D#0" in pr.final, limit=0.5, dt=0.001)  # not at its watchdog
    assert pr.final["D#0"] == "failed" and out.of("D#0", pr.d_id, ReportFailed)
    assert cluster.engines["P#0"].side.counters["refused_draining"] == 1
    failures = [m for m in map(decode, sent) if isinstance(m, Failure)]
    assert [m.reason for m in failures] == ["draining"]
    cluster.settle()  # P never admitted the request (it drains): only D held blocks for it
    assert cluster.ledger.quiescence() == [f"terminal/no leak: P#0 never released {pr.key}"]


@pytest.mark.parametrize("mode", MODES)
def test_a_transfer_under_way_finishes_and_then_p_is_drained(mode: Mode) -> None:
    cluster = Cluster(mode, faults=SimFaults(transfer_latency=0.05))
    warm(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    p = cluster.engines["P#0"].side
    run_until(cluster, lambda: p.requests[pr.p_id].state in ("writing", "reading"), dt=1e-3)
    _drain(cluster, "P#0")
    _drain(cluster, "P#0")  # asking again changes nothing
    assert _engine_state(cluster, "P#0") == "draining"
    cluster.settle()
    assert pr.final == {"P#0": "done", "D#0": "done"}
    assert _engine_state(cluster, "P#0") == "drained"
    settled(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_a_lease_with_no_transfer_is_cut_and_d_hears_draining(mode: Mode) -> None:
    cluster = Cluster(mode)
    warm(cluster)
    out = Outputs(cluster)
    cluster._admit_d = lambda pr: None  # type: ignore[method-assign]
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    del cluster._admit_d
    assert cluster.engines["P#0"].side.requests[pr.p_id].state == "leased"
    _drain(cluster, "P#0")
    assert pr.final["P#0"] == "expired" and out.releases("P#0", pr.p_id)  # not at lease_s
    assert _engine_state(cluster, "P#0") == "drained"
    cluster._admit_d(pr)  # D asks for it after all: refused at once
    run_until(cluster, lambda: "D#0" in pr.final, limit=0.5, dt=0.001)
    assert pr.final["D#0"] == "failed" and out.of("D#0", pr.d_id, ReportFailed)
    settled(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_a_draining_d_refuses_admission_and_finishes_its_loads(mode: Mode) -> None:
    cluster = Cluster(mode)
    pr = cluster.admit("r", 4)
    _drain(cluster, "D#0")
    assert _engine_state(cluster, "D#0") == "draining"
    with pytest.raises(LocalProtocolError, match="draining"):
        cluster.engines["D#0"].submit(Admit("late", blocks(9), "P", 1, ""))
    cluster.finish_prefill("r")
    cluster.settle()
    assert pr.final == {"P#0": "done", "D#0": "done"}
    assert _engine_state(cluster, "D#0") == "drained"
    settled(cluster)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["drain", "shutdown"])
def test_goodbye_unloads_the_agent_on_the_peer(mode: Mode, how: str) -> None:
    cluster = Cluster(mode)
    warm(cluster)
    d = cluster.engines["D#0"]
    assert d.peers == 1 and d.side.peers["P#0"].state == "connected"
    removed = d.counters["peers_removed"]
    cluster.engines["P#0"].submit(Drain() if how == "drain" else Shutdown())
    cluster.collect()
    run_until(cluster, lambda: d.peers == 0, limit=0.5, dt=0.001)
    assert d.side.peers["P#0"].state == "evicted"
    assert d.side.counters["goodbyes"] == 1
    assert d.counters["peers_removed"] == removed + 1
    # The next request meets a serving P afresh: D handshakes again.
    if how == "drain":
        assert cluster.engines["P#0"].side.counters["goodbyes_sent"] == 1


def test_draining_twice_changes_nothing_and_shutdown_closes() -> None:
    cluster = Cluster("push")
    _drain(cluster, "P#0")
    _drain(cluster, "P#0")
    assert _engine_state(cluster, "P#0") == "drained"
    cluster.engines["P#0"].submit(Shutdown())
    assert _engine_state(cluster, "P#0") == "closed"


def test_shutdown_says_no_goodbye_to_a_peer_a_transfer_still_uses() -> None:
    """A goodbye ends the peer's side of the requests using us: while our WRITE may still land,
    D must not hear it (it would release the blocks); it learns of the loss from the fabric."""
    cluster = Cluster("push", faults=SimFaults(transfer_latency=0.05))
    warm(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    p = cluster.engines["P#0"]
    run_until(cluster, lambda: p.side.requests[pr.p_id].state == "writing", dt=1e-3)
    p.submit(Shutdown())
    cluster.collect()
    assert p.side.counters["goodbyes_sent"] == 0
    assert cluster.engines["D#0"].side.peers["P#0"].state == "connected"
