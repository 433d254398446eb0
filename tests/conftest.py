"""Hypothesis profiles and the transition coverage report.

CI (``CI=true``) runs derandomised with a fixed budget; ``HYPOTHESIS_PROFILE=soak`` runs the long
local soak; anything else gets a quick randomised profile.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,
    "database": None,  # runs are reproducible from the profile alone, as on a fresh clone
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "stateful_step_count": 50,
}
settings.register_profile("ci", derandomize=True, max_examples=300, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=40, **_COMMON)
settings.register_profile("soak", max_examples=2500, **_COMMON)
_default = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print which model transitions the run never took."""
    from kvfsm.testing import COVERAGE, untaken_transitions

    if not COVERAGE:
        return
    untaken = untaken_transitions()
    taken = len({k for k in COVERAGE})
    terminalreporter.section("model transition coverage")
    terminalreporter.write_line(f"{taken} distinct transitions taken; {len(untaken)} never taken")
    for lifecycle, source, event, dest in untaken:
        terminalreporter.write_line(f"  never taken: {lifecycle}: {source} --{event}--> {dest}")
