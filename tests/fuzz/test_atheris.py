"""The atheris (libFuzzer) harness, run for a bounded number of inputs per target: a crash, an
input that does not re-encode to itself, or an error other than the decoder's own fails it.
`make fuzz` runs the same harness for minutes. Skipped where atheris is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HARNESS = Path(__file__).with_name("atheris_fuzz.py")
RUNS = {"wire": 50_000, "request": 50_000, "reply": 50_000, "scenario": 1_500}
"""Inputs per target: a few seconds each here (scenarios go through a file)."""


@pytest.mark.parametrize("target", RUNS)
def test_atheris_target(target: str, tmp_path: Path) -> None:
    runs = RUNS[target]
    done = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            target,
            f"-runs={runs}",
            "-seed=1",
            f"-artifact_prefix={tmp_path}/",
            str(tmp_path / "corpus"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KVFSM_FUZZ_SCRATCH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"Done {runs} runs" in done.stderr
    assert not list(tmp_path.glob("crash-*"))
