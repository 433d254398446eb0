"""The scenarios whose faults exist on the real fabric pass there too: real NIXL agents, real time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfsm.cli.scenario import load_scenario, run_scenario

pytestmark = pytest.mark.nixl

LIBRARY = Path(__file__).parents[1] / "scenarios"
ON_NIXL = [p for p in sorted(LIBRARY.glob("*.toml")) if "nixl" in load_scenario(p).fabrics]


def test_some_scenarios_run_on_the_real_fabric() -> None:
    assert len(ON_NIXL) >= 4


@pytest.mark.parametrize("path", ON_NIXL, ids=[p.stem for p in ON_NIXL])
def test_scenario_passes_on_nixl(path: Path) -> None:
    report = run_scenario(load_scenario(path), "nixl")
    assert report.fabric == "nixl"
    assert report.passed, report.violations + report.unmet


def test_json_on_the_real_fabric_is_only_json() -> None:
    """`kvfsm scenario --fabric nixl --json`: NIXL's own log lines (it logs to the `sys.stdout`
    it found when first imported) go to stderr; stdout parses whole."""
    exe = Path(sys.executable).parent / "kvfsm"
    scenario = LIBRARY / "d_aborts_after_registration.toml"
    result = subprocess.run(
        [str(exe), "scenario", "--fabric", "nixl", "--json", str(scenario)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = result.stdout.splitlines()
    assert json.loads(line)["violations"] == []
    assert "NIXL INFO" in result.stderr  # the log went where it belongs
