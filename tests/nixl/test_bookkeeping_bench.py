"""benchmarks/bookkeeping_thread.py: the raw loop with the engine-sized Python work inline and
on a helper thread, real NIXL agents in two processes; every variant runs to the end with its
bytes checked (a mismatch fails the script); the figures themselves are not asserted."""

from __future__ import annotations

import importlib.util
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
    plain, inline = report["rows"][:2]
    assert plain["ratio_to_plain"] == 1
    assert all(row["post_us"] > 0 for row in report["rows"])  # every request was posted
    assert plain["work_us"] == 0 and all(row["work_us"] > 0 for row in report["rows"][1:])
    assert plain["overlap_us"] == 0 == inline["overlap_us"]  # one thread: nothing overlaps


def test_overlap_counts_only_the_time_both_threads_were_inside_a_span() -> None:
    spec = importlib.util.spec_from_file_location("bookkeeping_thread", _SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    posts, work = module._Timed(), module._Timed()
    posts.spans = [(0.0, 2.0), (3.0, 5.0), (9.0, 10.0)]
    work.spans = [(1.0, 4.0), (4.5, 6.0), (7.0, 8.0)]
    assert posts.overlap(work) == work.overlap(posts) == 1.0 + 1.0 + 0.5
    assert posts.total() == 5.0 and posts.overlap(module._Timed()) == 0.0
