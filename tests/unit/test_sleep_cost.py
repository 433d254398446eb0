"""benchmarks/sleep_cost.py runs and reports both kinds of sleep for every timeout asked (its
figures are not asserted: benchmarks print them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).parents[2] / "benchmarks" / "sleep_cost.py"


def test_sleep_cost_reports_wall_and_cpu_per_sleep_for_each_timeout() -> None:
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--timeouts-us", "20", "500", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    rows = json.loads(out.stdout)
    assert [row["timeout_us"] for row in rows] == [20.0, 500.0]
    for row in rows:
        figures = {k: v for k, v in row.items() if k != "timeout_us"}
        assert set(figures) == {
            "condition_wall_us", "condition_cpu_us", "sleep_wall_us", "sleep_cpu_us",
        }  # fmt: skip
        assert all(v >= 0 for v in figures.values())
