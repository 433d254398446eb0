"""benchmarks/handoff_loop.py runs both loops over real NIXL and reports every request received
(its figures are printed, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

_SCRIPT = Path(__file__).parents[2] / "benchmarks" / "handoff_loop.py"


def test_the_benchmark_reports_both_loops_and_every_request_received() -> None:
    args = ["--mode", "pull", "--requests", "5", "--model", "tiny", "--max-blocks", "2", "--json"]
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.stdout)
    for loop in ("event", "poll1ms"):
        assert report[f"received_{loop}"] == report[f"done_{loop}"] == 5
        assert report[f"bytes_checked_{loop}"] > 0 and report[f"bytes_wrong_{loop}"] == 0
        assert report[f"errors_{loop}"] == []
        assert 0 < report[f"handoff_{loop}_ms_p50"] <= report[f"handoff_{loop}_ms_p99"]
    assert report["ratio_event_poll1ms"] > 0
