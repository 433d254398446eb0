"""benchmarks/bookkeeping_thread.py: the raw loop with the engine-sized Python work inline and
on a helper thread, real NIXL agents in two processes; every variant runs to the end with its
bytes checked (a mismatch fails the script); the figures themselves are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bookkeeping_thread.py"


def test_bookkeeping_bench_runs_every_variant_with_bytes_checked() -> None:
    args = ["--regions", "1", "--blocks-per-request", "2", "--requests", "6", "--rounds", "1"]
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), *args, "--work-us", "20", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert report["mib_per_request"] == 2 * 16 / 1024
    variants = [row["variant"] for row in report["rows"]]
    assert variants == [
        "plain", "inline", "thread, switch 5000 us", "thread, switch 250 us", "thread, switch 50 us"
    ]  # fmt: skip
    assert all(len(row["gbps_runs"]) == 1 and row["gbps"] > 0 for row in report["rows"])
    assert report["rows"][0]["ratio_to_plain"] == 1
