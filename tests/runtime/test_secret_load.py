"""With the shared secret on, load loses nothing: a thousand requests in flight at once, their
notifications numbered when posted and delivered in whatever order the transfers and the
network finish them, all end `done` with their bytes checked, and nothing is counted as a
replay (docs/security.md). On the simulated fabric with heavy reordering, and on real NIXL."""

from __future__ import annotations

import os

import pytest

from kvfsm.core import CoreConfig, Mode
from kvfsm.fabric import SimFaults
from kvfsm.sim import Cluster
from kvfsm.wire import SharedSecret

pytestmark = pytest.mark.nixl

IN_FLIGHT = 1000
SECRET = SharedSecret(os.urandom(32))
# The default deadlines: nothing here should come near them.
CONFIG = CoreConfig()
# Completions trail their posts and up to half the notifications are held back up to 0.2 s:
# hundreds of later-numbered ones overtake them.
REORDERING = SimFaults(transfer_latency=0.01, delay_notif=0.5, max_notif_delay=0.2)


def _serve_all_at_once(c: Cluster) -> None:
    for i in range(IN_FLIGHT):
        c.admit(f"r{i}", 1 + i % 3)
    for i in range(IN_FLIGHT):
        c.finish_prefill(f"r{i}")
    c.settle()


def _assert_all_done(c: Cluster) -> None:
    assert c.ledger.violations == [] and c.ledger.quiescence() == []
    finals = {state for pr in c.requests.values() for state in pr.final.values()}
    assert finals == {"done"}, finals
    for engine in c.engines.values():
        assert engine.counters["replayed"] == 0 and engine.counters["unauthenticated"] == 0


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 4)])
def test_a_thousand_in_flight_on_the_simulated_fabric(mode: Mode, p_tp: int, d_tp: int) -> None:
    c = Cluster(
        mode,
        config=CONFIG,
        faults=REORDERING,
        num_blocks=2 * IN_FLIGHT * 2,
        p_tp=p_tp,
        d_tp=d_tp,
        secret=SECRET,
        conformance=False,
        trace=False,
    )
    _serve_all_at_once(c)
    _assert_all_done(c)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_thousand_in_flight_on_real_nixl(mode: Mode) -> None:
    c = Cluster(
        mode,
        config=CONFIG,
        num_blocks=2 * IN_FLIGHT * 2,
        fabric="nixl",
        secret=SECRET,
        conformance=False,
        trace=False,
    )
    try:
        _serve_all_at_once(c)
        _assert_all_done(c)
    finally:
        c.close()
