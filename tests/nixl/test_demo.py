"""`kvfsm demo --fabric nixl` as a user runs it: P and D in separate processes over real NIXL,
the handshake over ZMQ on loopback, every byte checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfsm._nixl_demo import run_nixl_demo


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_two_processes_move_verified_kv(mode: str) -> None:
    report = run_nixl_demo(mode, 12, seed=1, memory_mib=64)  # type: ignore[arg-type]
    assert report.fabric == "nixl" and report.requests == report.done == 12
    assert report.failed == report.expired == report.aborted == 0
    assert report.verified and report.violations == []
    assert report.bytes > 0 and report.handoff_ms_p99 >= report.handoff_ms_p50 > 0
    assert report.finals == {"P:done": 12, "D:done": 12}


def test_cli_default_is_the_real_fabric() -> None:
    exe = Path(sys.executable).parent / "kvfsm"
    result = subprocess.run(
        [str(exe), "demo", "--requests", "6", "--json"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["fabric"] == "nixl" and report["done"] == 6 and report["verified"] is True
    assert {"gbps", "handoff_ms_p50", "handoff_ms_p99"} <= report.keys()
