"""Every script in examples/ runs as a user runs it (`python examples/NAME.py`) and says it
moved what it should: exit 0 and its own summary line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAYS = {
    "sim_pair.py": "P: done, D: done, bytes equal: True",
    "nixl_pair.py": "P: done, D: done, bytes equal: True",
    "scenario_in_code.py": "passed",
}


def test_every_example_is_run_here() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(SAYS)


@pytest.mark.parametrize("name", sorted(SAYS))
def test_the_example_runs(name: str) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert SAYS[name] in result.stdout.splitlines()[-1]
