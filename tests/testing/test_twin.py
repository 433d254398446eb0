"""The stateful programs on SimFabric and on real NIXL with the real ZMQ side channel, step by
step (`kvfsm.testing.twin`): safety and conformance on both, the same states after every step,
the same final states, reports to the caller and D bytes at the end."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvfsm.testing.twin import TwinMachine, twin_for
from kvfsm.wire import SharedSecret

pytestmark = pytest.mark.nixl

# Half the machines run as a deployment beyond one host should: a shared secret on the side
# channel and on every notification, on both fabrics.
_SECRET = SharedSecret(b"twin-programs-shared-secret")

MACHINES = (
    twin_for("push"),
    twin_for("pull"),
    twin_for("push", 1, 2, secret=_SECRET),
    twin_for("pull", 2, 1, secret=_SECRET),
    twin_for("push", 2, 1, d_block_size=8),
    twin_for("pull", 1, 2, d_block_size=8, secret=_SECRET),
)


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.__name__)
def test_sim_and_real_run_alike(machine: type[TwinMachine]) -> None:
    # An eighth of the profile's programs per machine (37 in CI, 312 in `make soak`).
    programs = max(5, settings().max_examples // 8)
    run_state_machine_as_test(
        machine,
        settings=settings(
            settings(),
            max_examples=programs,
            stateful_step_count=25,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_the_programs_reach_every_fault_and_ending() -> None:
    """Runs after the machines above (alone, it runs them): the programs injected every fault
    on the real fabric and ended requests every way on both sides."""
    if TwinMachine.programs == 0:
        for machine in MACHINES:
            test_sim_and_real_run_alike(machine)
    print(
        f"\ntwin: {TwinMachine.programs} programs, {TwinMachine.steps} steps, {dict(TwinMachine.taken)}"
    )
    wanted = {"refuse", "hang", "post", "kill"}
    wanted |= {f"{side} {state}" for side in "PD" for state in ("done", "failed", "aborted")}
    wanted |= {"P expired", "D expired"}
    assert wanted <= set(TwinMachine.taken), sorted(wanted - set(TwinMachine.taken))


def test_a_difference_between_the_fabrics_is_caught() -> None:
    """The comparison is not vacuous: a post refused on the real fabric only is seen at once."""
    twin = twin_for("push")()
    try:
        twin.real.refuse_next_post("P#0")
        twin.admit(2, 0, False)
        twin.finish_prefill_of("r1")
        with pytest.raises(AssertionError, match="states differ"):
            twin.safe_and_alike()
    finally:
        twin.real.close()
