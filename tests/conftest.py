"""Hypothesis profiles, the transition coverage report (over every xdist worker), and the order
files run in.

CI (``CI=true``) runs derandomised with a fixed budget; ``HYPOTHESIS_PROFILE=soak`` runs the long
local soak; anything else gets a quick randomised profile.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

_COMMON: dict[str, Any] = {
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

# The longest files first (vLLM engines, then real NIXL agents): with xdist's `loadfile` the
# short ones then fill in at the end, instead of one worker running a vLLM file alone.
_FIRST = ("vllm", "nixl")


def _rank(item: pytest.Item) -> int:
    marks = {mark.name for mark in item.iter_markers()}
    return next((i for i, name in enumerate(_FIRST) if name in marks), len(_FIRST))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the files, keeping each file's own order (a stable sort)."""
    items.sort(key=_rank)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand the transitions this process took to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        from kvfsm.sim import COVERAGE

        workeroutput["coverage"] = [[*key, n] for key, n in COVERAGE.items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """On the xdist controller: add a finished worker's transitions to this process's."""
    from kvfsm.sim import COVERAGE

    for *key, n in getattr(node, "workeroutput", {}).get("coverage", []):
        COVERAGE[tuple(key)] += n


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print which model transitions the run never took (every worker's, under xdist)."""
    from kvfsm.sim import COVERAGE, untaken_transitions

    if not COVERAGE:
        return
    untaken = untaken_transitions()
    taken = len({k for k in COVERAGE})
    terminalreporter.section("model transition coverage")
    terminalreporter.write_line(f"{taken} distinct transitions taken; {len(untaken)} never taken")
    for lifecycle, source, event, dest in untaken:
        terminalreporter.write_line(f"  never taken: {lifecycle}: {source} --{event}--> {dest}")
