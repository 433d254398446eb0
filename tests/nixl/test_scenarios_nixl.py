"""The scenarios whose faults exist on the real fabric pass there too: real NIXL agents, real time."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfsm.cli.scenario import load_scenario, run_scenario

LIBRARY = Path(__file__).parents[1] / "scenarios"
ON_NIXL = [p for p in sorted(LIBRARY.glob("*.toml")) if "nixl" in load_scenario(p).fabrics]


def test_some_scenarios_run_on_the_real_fabric() -> None:
    assert len(ON_NIXL) >= 4


@pytest.mark.parametrize("path", ON_NIXL, ids=[p.stem for p in ON_NIXL])
def test_scenario_passes_on_nixl(path: Path) -> None:
    report = run_scenario(load_scenario(path), "nixl")
    assert report.fabric == "nixl"
    assert report.passed, report.violations + report.unmet
