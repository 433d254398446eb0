"""The stateful suite: P and D engines on SimFabric under every event and fault, with the six
safety properties checked after every step (see kvfsm.testing)."""

from __future__ import annotations

from kvfsm.fabric import SimFaults
from kvfsm.testing import machine_for

# Transfers that stay in flight a while, so aborts, cancels and deaths land mid-transfer.
_SLOW = SimFaults(transfer_latency=0.25)
_NOISY = SimFaults(
    transfer_latency=0.05,
    drop_notif=0.02,
    duplicate_notif=0.02,
    delay_notif=0.05,
    reorder_notif=0.05,
)

TestPush = machine_for("push").TestCase
TestPull = machine_for("pull").TestCase
TestPushSlow = machine_for("push", faults=_SLOW).TestCase
TestPullSlow = machine_for("pull", faults=_SLOW).TestCase
TestPushOneToTwo = machine_for("push", 1, 2, _NOISY).TestCase
TestPullTwoToOne = machine_for("pull", 2, 1, _NOISY).TestCase
TestPushTwoToOne = machine_for("push", 2, 1, _SLOW).TestCase
TestPullOneToTwo = machine_for("pull", 1, 2, _SLOW).TestCase
