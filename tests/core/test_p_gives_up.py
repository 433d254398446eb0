"""P tells every D rank it can reach as soon as it gives up on a request the rank registered for,
in both modes and under TP mismatch: D ends the request within a notification round trip, not at
its watchdog. A rank P cannot reach at all ends at its own watchdog (docs/lifecycles.md).

The helpers are test_core.py's."""

from __future__ import annotations

import pytest

from kvfsm.core import Mode, ReportFailed
from kvfsm.sim import Cluster
from tests.core.fixtures import MODES, Outputs, config, run_until, settled, state

SLOW_WATCHDOG = config(watchdog_s=10.0, producer_stall_s=10.0, fence_s=3.0, lease_s=1.0)
"""Bounds far beyond a notification round trip (the simulated fabric's take microseconds)."""


def _ends(cluster: Cluster, key: str, agent: str, out: Outputs, within: float) -> float:
    """When `key` ended on `agent`, which must be within `within` seconds from now."""
    rid = cluster.requests[key].p_id if agent.startswith("P") else cluster.requests[key].d_id
    start = cluster.now
    run_until(cluster, lambda: bool(out.finished(agent, rid)), limit=within, dt=0.001)
    return cluster.now - start


@pytest.mark.parametrize("mode", MODES)
def test_the_reachable_rank_hears_at_once_the_unreachable_one_at_its_watchdog(mode: Mode) -> None:
    cluster = Cluster(mode, p_tp=1, d_tp=2, config=SLOW_WATCHDOG)
    cluster.directory.fail_next("D#1", times=1000)  # P never reaches D#1
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    _ends(cluster, "r", "P#0", out, within=0.5)  # not its stall bound (10 s)
    _ends(cluster, "r", "D#0", out, within=0.5)  # not its watchdog (10 s)
    assert pr.final["P#0"] == "failed"
    if pr.final["D#0"] != "done":  # in pull D#0 may have read its part before P gave up
        assert pr.final["D#0"] == "failed" and out.of("D#0", pr.d_id, ReportFailed)
    assert "D#1" not in pr.final
    waited = _ends(cluster, "r", "D#1", out, within=20.0)
    assert waited > 5.0 and pr.final["D#1"] in ("expired", "failed")  # its watchdog
    settled(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_reached_again_hears_at_once(mode: Mode) -> None:
    cluster = Cluster(mode, p_tp=1, d_tp=2, config=SLOW_WATCHDOG)
    cluster.directory.fail_next("D#1")  # one handshake fails; P's reply retries it
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    for agent in ("P#0", "D#0", "D#1"):
        _ends(cluster, "r", agent, out, within=0.5)
    assert pr.final["P#0"] == "failed" and pr.final["D#1"] == "failed"
    assert out.of("D#1", pr.d_id, ReportFailed)
    settled(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_d_hears_of_p_s_abort_while_p_connects(mode: Mode) -> None:
    """P matched D's registration but its handshake with D hangs; P's caller aborts: P tells D
    once the connection is up, instead of D waiting for its watchdog."""
    cluster = Cluster(mode, config=SLOW_WATCHDOG)
    cluster.directory.hang_next("D#0", seconds=1.5)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    run_until(cluster, lambda: state(cluster, "P#0", pr.p_id) == "matched", dt=0.001)
    cluster.abort("r", "P")
    assert pr.final["P#0"] == "aborted"
    _ends(cluster, "r", "D#0", out, within=2.0)  # when the hung handshake answers
    assert pr.final["D#0"] == "failed" and out.of("D#0", pr.d_id, ReportFailed)
    settled(cluster)
