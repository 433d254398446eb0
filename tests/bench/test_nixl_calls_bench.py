"""benchmarks/nixl_calls.py: raw NIXL and the engine with every NIXL call timed in the bench
processes; the counts per request are checked, the times are not (benchmarks print them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

_SCRIPT = Path(__file__).parents[2] / "benchmarks" / "nixl_calls.py"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_every_request_is_posted_once_and_only_the_engine_sends_notifications(mode: str) -> None:
    args = ["--mode", mode, "--requests", "6", "--regions", "1", "--rounds", "1", "--json"]
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.stdout)
    raw, engine = report["a2"], report["b"]
    # Counted from the warm-up's transfer on: one post per timed request, on either side.
    assert raw["calls"]["transfer"][0] == 1.0 == engine["calls"]["transfer"][0]
    assert "send_notif" not in raw["calls"] and "get_new_notifs" not in raw["calls"]
    assert engine["calls"]["send_notif"][0] >= 1.0  # push: P's Progress; pull: D's registration
    for side in (raw, engine):
        inside = sum(us for _, us in side["calls"].values())
        assert side["nixl_us"] == pytest.approx(inside) and side["wall_us"] > 0
