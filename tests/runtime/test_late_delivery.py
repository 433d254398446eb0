"""Bytes of a transfer given up on that still land (UCX over TCP): D holds the blocks of a request
it gave up on until the fabric's late-delivery bound has passed, and only then hands them back.

The simulated fabric's `late_delivery` fault lands a released transfer's bytes that much later;
the ledger flags a release while such bytes are still due. `tcp_late_delivery_s` derives the
real fabric's bound from UCX's settings, and `Engine` refuses a configured hold below it.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from kvfsm.core import Abort, Consumer, Identity, Mode, Request
from kvfsm.fabric import (
    TCP_DRAIN_SLACK_S,
    SimFaults,
    SimNetwork,
    tcp_late_delivery_s,
)
from kvfsm.runtime import Engine, KvCache
from kvfsm.sidechannel import LocalDirectory
from kvfsm.sim import FAST_CONFIG, SMALL_GEOMETRY, Cluster
from tests.core.fixtures import MODES, Outputs, run, run_until, settled, warm

LATE = 0.5
TCP = SimFaults(transfer_latency=0.01, late_delivery=LATE)


def _abort_in_flight(cluster: Cluster, mode: Mode) -> tuple[Outputs, str]:
    """Admit a request whose transfer never completes, abort it on D once it is in flight (the
    stall bound ends it); the outputs and D's id."""
    warm(cluster)
    cluster.network.inject_next_post("P#0" if mode == "push" else "D#0", "stuck")
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    run_until(cluster, lambda: any(e.inflight for e in cluster.live_engines()), limit=1.0)
    cluster.engines["D#0"].submit(Abort(pr.d_id))
    cluster.collect()
    return out, pr.d_id


@pytest.mark.parametrize("mode", MODES)
def test_d_holds_given_up_blocks_until_late_bytes_cannot_land(mode: Mode) -> None:
    cluster = Cluster(mode, faults=TCP)
    d = cluster.engines["D#0"].side
    assert d.transport_drain_s == LATE  # taken from the fabric
    out, rid = _abort_in_flight(cluster, mode)
    run_until(cluster, lambda: bool(out.finished("D#0", rid)), limit=10.0)
    [(t_end, fin)] = out.finished("D#0", rid)
    assert fin.state == "aborted"
    assert out.releases("D#0", rid) == [] and d.quarantine.holds(rid)
    run_until(cluster, lambda: bool(out.releases("D#0", rid)), limit=2 * LATE)
    [t_release] = out.releases("D#0", rid)
    assert t_release >= t_end + LATE and not d.quarantine.holds(rid)
    assert cluster.network.stats.late_bytes > 0  # bytes did land late, into held blocks
    settled(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_without_the_hold_the_ledger_sees_bytes_land_in_handed_back_blocks(mode: Mode) -> None:
    cluster = Cluster(mode, faults=TCP)
    cluster.engines["D#0"].side.transport_drain_s = 0.0  # the bug: hand back at once
    out, rid = _abort_in_flight(cluster, mode)
    run(cluster, 6.0)
    assert out.releases("D#0", rid)
    assert any("bytes still due" in v for v in cluster.ledger.violations)


@pytest.mark.parametrize("mode", MODES)
def test_a_request_that_was_received_is_never_held(mode: Mode) -> None:
    cluster = Cluster(mode, faults=TCP)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    run_until(cluster, lambda: bool(out.finished("D#0", pr.d_id)), limit=5.0)
    [(t_end, fin)] = out.finished("D#0", pr.d_id)
    assert fin.state == "done" and out.releases("D#0", pr.d_id) == [t_end]
    settled(cluster)


def _hand_back_at_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: D hands a registered request's blocks back as it aborts, without waiting
    for P to confirm that no WRITE can land."""
    fence = Consumer._req_cmd_arm_fence

    def fence_and_release(self: Consumer, req: Request) -> None:
        fence(self, req)
        self._req_cmd_release_blocks(req)

    monkeypatch.setattr(Consumer, "_req_cmd_arm_fence", fence_and_release)


@pytest.mark.parametrize("planted", [True, False])
def test_a_write_into_handed_back_blocks_is_flagged_at_latency_zero(
    monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    """With no transfer latency (the simulated fabric's default) a WRITE completes inside its
    post: the ledger sees its bytes land, not only transfers still in flight."""
    if planted:
        _hand_back_at_abort(monkeypatch)
    cluster = Cluster("push")
    assert cluster.network.faults.transfer_latency == 0
    warm(cluster)
    pr = cluster.admit("r", 4)
    p_req = cluster.engines["P#0"].side.requests[pr.p_id]
    run_until(cluster, lambda: bool(p_req.links))  # D registered its blocks at P
    cluster.abort("r", "D")  # D's cancel is on its way...
    cluster.finish_prefill("r")  # ...and P posts its WRITE before it arrives
    assert cluster.network.stats.xfers_done == 2  # the warm-up's and this one, inside the post
    late = [v for v in cluster.ledger.violations if v.startswith("no late write")]
    if planted:
        assert late and "held by no request" in late[0]
    else:
        assert late == []
        settled(cluster)


def test_the_engine_takes_the_fabrics_bound_and_refuses_a_lower_one() -> None:
    net = SimNetwork(faults=SimFaults(late_delivery=2.0))
    kv = KvCache.allocate(SMALL_GEOMETRY)
    directory = LocalDirectory()

    def engine(**changes: object) -> Engine:
        config = msgspec.structs.replace(FAST_CONFIG, **changes)
        side = Consumer(Identity("D"), "push", config)
        return Engine(
            side, net.agent(f"D{len(changes)}{changes}"), kv, directory.view(), lambda: 0.0
        )

    assert engine().side.transport_drain_s == 2.0
    assert engine(transport_drain_s=5.0).side.transport_drain_s == 5.0
    with pytest.raises(ValueError, match=r"transport_drain_s=1.0 is below"):
        engine(transport_drain_s=1.0)


def test_a_negative_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="drain >= 0"):
        msgspec.structs.replace(FAST_CONFIG, transport_drain_s=-1.0)


@pytest.mark.parametrize(
    ("env", "bound"),
    [
        ({}, 10.0 + TCP_DRAIN_SLACK_S),  # kvfsm's default timeout
        ({"UCX_TCP_USER_TIMEOUT": "1s"}, 1.0 + TCP_DRAIN_SLACK_S),
        ({"UCX_TCP_USER_TIMEOUT": "500ms"}, 0.5 + TCP_DRAIN_SLACK_S),
        ({"UCX_TCP_USER_TIMEOUT": "3"}, 3.0 + TCP_DRAIN_SLACK_S),  # UCX's unit is seconds
        ({"UCX_TCP_USER_TIMEOUT": "2m"}, 120.0 + TCP_DRAIN_SLACK_S),
        ({"UCX_TCP_USER_TIMEOUT": "inf"}, math.inf),
        ({"UCX_TLS": "tcp", "UCX_TCP_USER_TIMEOUT": "1s"}, 1.0 + TCP_DRAIN_SLACK_S),
        ({"UCX_TLS": "all"}, 10.0 + TCP_DRAIN_SLACK_S),
        ({"UCX_TLS": "rc,ud,sm,self"}, 0.0),  # no TCP: a released handle stops the transfer
        ({"UCX_TLS": "^tcp"}, 0.0),
        ({"UCX_TLS": "^rc"}, 10.0 + TCP_DRAIN_SLACK_S),
    ],
)
def test_the_tcp_bound_follows_ucx_settings(env: dict[str, str], bound: float) -> None:
    assert tcp_late_delivery_s(env) == pytest.approx(bound)


def test_a_timeout_ucx_would_not_take_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="UCX_TCP_USER_TIMEOUT='soon'"):
        tcp_late_delivery_s({"UCX_TCP_USER_TIMEOUT": "soon"})
