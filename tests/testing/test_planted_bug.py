"""The suite catches planted protocol bugs: P counting a transfer complete on the first of two
expected results (freeing its blocks while a second D rank still reads them, or telling D's
caller its blocks arrived while a second P rank still writes); D handing back the blocks of a
request it gave up on at once, while a released transfer's bytes are still on their way (UCX
over TCP)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvfsm.core import Consumer, Side, TransferTally
from kvfsm.fabric import SimFaults
from kvfsm.testing.stateful import machine_for

# Slow transfers and unevenly delayed notifications, so two D ranks' READs (or two P ranks' WRITEs)
# of one request do not end at the same instant.
_SLOW = SimFaults(transfer_latency=0.25, delay_notif=0.5, max_notif_delay=0.3)
_BUDGET = settings(
    database=None,  # as the profiles: also in the fresh interpreter below, which loads none
    max_examples=1000,
    derandomize=True,
    deadline=None,
    stateful_step_count=30,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.generate),  # finding the bug is the point, not shrinking it
)


def _first_result_completes(self: Side, tally: TransferTally) -> bool:
    return False  # the bug: "no results outstanding" after the first one


@pytest.mark.parametrize(("mode", "p_tp", "d_tp"), [("pull", 1, 2), ("push", 2, 1)])
def test_planted_early_completion_is_caught(
    monkeypatch: pytest.MonkeyPatch, mode: str, p_tp: int, d_tp: int
) -> None:
    monkeypatch.setattr(Side, "_tally_guard_outstanding", _first_result_completes)
    machine = machine_for(mode, p_tp, d_tp, _SLOW)  # type: ignore[arg-type]
    with pytest.raises((AssertionError, Flaky)) as caught:
        run_state_machine_as_test(machine, settings=_BUDGET)
    found = str(caught.value)
    assert any(p in found for p in ("no early free", "no late write", "no silent corruption"))


def test_same_machines_pass_without_the_bug() -> None:
    """The control: unpatched, the same machines and budget find nothing."""
    for mode, p_tp, d_tp in [("pull", 1, 2), ("push", 2, 1)]:
        machine = machine_for(mode, p_tp, d_tp, _SLOW)  # type: ignore[arg-type]
        run_state_machine_as_test(machine, settings=settings(_BUDGET, max_examples=60))


_TCP = SimFaults(transfer_latency=0.25, late_delivery=0.6)


def _search_without_the_hold(mode: str, p_tp: int, d_tp: int) -> str:
    """Run the search with D's hold removed; what it found ("" if nothing).

    Programs of two lengths, each with its own derandomised draw: which 1,000 programs one draw
    tries shifts whenever the package's source does, and one draw alone has missed the bug."""
    Consumer._may_still_land = lambda self, req: False  # type: ignore[method-assign]
    machine = machine_for(mode, p_tp, d_tp, _TCP)  # type: ignore[arg-type]
    for steps in (30, 50):
        try:
            run_state_machine_as_test(
                machine, settings=settings(_BUDGET, stateful_step_count=steps)
            )
        except (AssertionError, Flaky) as exc:
            return str(exc)
    return ""


@pytest.mark.parametrize(("mode", "p_tp", "d_tp"), [("push", 1, 1), ("pull", 1, 2)])
def test_blocks_handed_back_before_late_bytes_land_are_caught(
    mode: str, p_tp: int, d_tp: int
) -> None:
    # In a fresh interpreter: in a pytest worker that ran other test files first, the same
    # derandomised search can take other paths.
    script = (
        "import sys; from tests.testing.test_planted_bug import _search_without_the_hold as s;"
        f"sys.stdout.write(s({mode!r}, {p_tp}, {d_tp}))"
    )
    env = {**os.environ, "CI": "true"}
    found = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=Path(__file__).parents[2],
    ).stdout
    assert "no late write" in found and "bytes still due" in found, found[-2000:]


def test_same_late_bytes_machines_pass_with_the_hold() -> None:
    """The control: D holds the blocks for the fabric's late-delivery bound; nothing found."""
    for mode, p_tp, d_tp in [("push", 1, 1), ("pull", 1, 2)]:
        machine = machine_for(mode, p_tp, d_tp, _TCP)  # type: ignore[arg-type]
        run_state_machine_as_test(machine, settings=settings(_BUDGET, max_examples=60))
