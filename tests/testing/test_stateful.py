"""The stateful suite: P and D engines on SimFabric under every event and fault, with the six
safety properties checked after every step (see kvfsm.sim)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvfsm.core import Mode
from kvfsm.fabric import SimFaults
from kvfsm.sim import SMALL_GEOMETRY, SMALL_MLA_GEOMETRY, untaken_transitions
from kvfsm.testing import run_tour
from kvfsm.testing.stateful import LifecycleMachine, machine_for
from kvfsm.wire import SharedSecret

# Transfers that stay in flight a while, so aborts, cancels and deaths land mid-transfer.
_SLOW = SimFaults(transfer_latency=0.25)
_NOISY = SimFaults(
    transfer_latency=0.05,
    drop_notif=0.02,
    duplicate_notif=0.02,
    delay_notif=0.05,
    reorder_notif=0.05,
)
_NHC = msgspec.structs.replace(SMALL_GEOMETRY, kv_layout="NHC")
_BLHNC = msgspec.structs.replace(SMALL_GEOMETRY, kv_layout="HNC", interleaved=True)
# A deployment's shared secret: the noisy fabrics below reorder, delay and duplicate sealed
# notifications, and only the duplicates may be refused as replays.
_SECRET = SharedSecret(b"stateful-programs-shared-secret")
# UCX over TCP: bytes of a transfer released in progress still land, up to 0.6 s later.
_TCP = SimFaults(transfer_latency=0.25, late_delivery=0.6)

MACHINES = (
    machine_for("push"),
    machine_for("pull"),
    # P's host clock days ahead of D's (push), D's ahead of P's (pull): deadlines cross hosts.
    machine_for("push", faults=_SLOW, clock_skew={"P": 3e5}),
    machine_for("pull", faults=_SLOW, clock_skew={"D": 3e5}),
    machine_for("push", 1, 2, _NOISY, secret=_SECRET),
    machine_for("pull", 2, 1, _NOISY, secret=_SECRET),
    machine_for("push", 2, 1, _SLOW),
    machine_for("pull", 1, 2, _SLOW),
    # Replicated (MLA) KV: one P rank moves the bytes, the other only notifies.
    machine_for("push", 2, 1, _SLOW, geometry=SMALL_MLA_GEOMETRY),
    machine_for("pull", 2, 1, _NOISY, geometry=SMALL_MLA_GEOMETRY),
    # D's blocks hold 2 or 4 of P's: prefix-cache hits align across block sizes.
    machine_for("push", 1, 2, _NOISY, d_block_size=8, secret=_SECRET),
    machine_for("pull", 1, 1, _SLOW, d_block_size=16),
    machine_for("push", 1, 1, _TCP),
    machine_for("pull", 1, 2, _TCP),
    # vLLM's LBNHC pages (tokens first): head slices move one run per token.
    machine_for("push", 2, 1, _SLOW, geometry=_NHC),
    machine_for("pull", 1, 2, _NOISY, geometry=_NHC, d_block_size=8),
    # vLLM's BLHNC: every layer's page of a block together.
    machine_for("push", 1, 2, _SLOW, geometry=_BLHNC, d_block_size=8),
)
TestPush, TestPull, TestPushSlow, TestPullSlow = (m.TestCase for m in MACHINES[:4])
TestPushOneToTwo, TestPullTwoToOne, TestPushTwoToOne, TestPullOneToTwo = (
    m.TestCase for m in MACHINES[4:8]
)
TestPushMla, TestPullMla, TestPushBigDBlocks, TestPullBigDBlocks = (
    m.TestCase for m in MACHINES[8:12]
)
TestPushLateBytes, TestPullLateBytes = (m.TestCase for m in MACHINES[12:14])
TestPushNhc, TestPullNhcBigDBlocks, TestPushBlhnc = (m.TestCase for m in MACHINES[14:])


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_tour_of_rare_interleavings_is_safe(mode: Mode) -> None:
    """Scripted interleavings random search rarely reaches keep every safety property."""
    problems = {name: found for name, found in run_tour(mode).items() if found}
    assert not problems


def test_every_model_transition_is_taken() -> None:
    """The stateful machines and the tour together take every transition of every model.

    Runs after the machines above in a whole-module run; run alone, it runs them itself."""
    if LifecycleMachine.examples_run == 0:
        for machine in MACHINES:
            run_state_machine_as_test(machine)
    for mode in ("push", "pull"):
        run_tour(mode)
    untaken = untaken_transitions()
    assert not untaken, "never taken:\n" + "\n".join(" ".join(edge) for edge in untaken)
