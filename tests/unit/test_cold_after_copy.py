"""benchmarks/cold_after_copy.py runs and reports every step it names (its figures are not
asserted: benchmarks print them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).parents[2] / "benchmarks" / "cold_after_copy.py"


def test_cold_after_copy_reports_each_step_warm_and_after_a_copy() -> None:
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--mib", "1", "--trials", "1", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    assert set(figures) == {"rows", "core", "engine"}
    for row in figures.values():
        assert set(row) == {"warm_us", "after_1mib_us"}
        assert all(v > 0 for v in row.values())
