"""The command line as a user runs it: `kvfsm demo --fabric sim` and `kvfsm diagrams --check`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvfsm.cli import main

_REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_demo_json_reports_every_request_done_and_verified(
    mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["demo", "--fabric", "sim", "--mode", mode, "--requests", "40", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0
    assert report["mode"] == mode and report["fabric"] == "sim"
    assert report["requests"] == report["done"] == 40
    assert report["failed"] == report["expired"] == 0
    assert report["verified"] is True and report["violations"] == []
    assert report["bytes"] > 0


def test_demo_across_tp_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "demo",
        "--fabric",
        "sim",
        "--requests",
        "20",
        "--p-tp",
        "2",
        "--mode",
        "pull",
        "--json",
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["done"] == 20 and report["verified"] and report["p_tp"] == 2


def test_demo_prints_a_table_without_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--fabric", "sim", "--requests", "10"]) == 0
    out = capsys.readouterr().out
    assert "every byte verified" in out and "time in state" in out


def test_demo_with_bigger_d_blocks_and_a_prefix_hit_mix(capsys: pytest.CaptureFixture[str]) -> None:
    # D's blocks hold 4x P's tokens; the demo mixes in partial and full prefix-cache hits on D.
    args = ["demo", "--fabric", "sim", "--requests", "30", "--d-block-size", "16", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["done"] == 30 and report["verified"] and report["d_block_size"] == 16


def test_demo_refuses_block_sizes_that_do_not_pair(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--fabric", "sim", "--p-block-size", "8", "--d-block-size", "12"]) == 2
    assert "must be a multiple of --p-block-size 8" in capsys.readouterr().err


def test_committed_diagrams_are_fresh() -> None:
    assert main(["diagrams", "--check", "--out", str(_REPO / "docs" / "diagrams")]) == 0


def test_diagrams_check_fails_on_a_stale_copy(tmp_path: Path) -> None:
    out = tmp_path / "diagrams"
    shutil.copytree(_REPO / "docs" / "diagrams", out)
    (out / "peer.md").write_text("edited by hand\n")
    assert main(["diagrams", "--check", "--out", str(out)]) == 1


def test_console_script_runs() -> None:
    exe = Path(sys.executable).parent / "kvfsm"
    result = subprocess.run(
        [str(exe), "demo", "--fabric", "sim", "--requests", "5", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["done"] == 5


def test_demo_fails_when_any_rank_of_either_side_did_not_end_done() -> None:
    """Every D rank done is not enough: P ranks whose requests failed fail the run, and the
    report says why, with the counters behind it."""
    from kvfsm.cli.demo._report import DemoReport, why_not_done

    report = DemoReport(
        mode="pull",
        fabric="nixl",
        requests=4,
        done=4,
        failed=0,
        expired=0,
        aborted=0,
        bytes=1,
        verified=True,
        violations=[],
        p_tp=1,
        d_tp=1,
        finals={"P:done": 3, "P:failed": 1, "D:done": 4},
        time_in_state_ms={},
        counters={"bytes": 1, "posted": 4, "stall_timeout": 1},
        simulated_s=0.0,
        cpu_s=0.0,
    )
    assert not report.ok
    assert why_not_done(report) == ["1 request(s) ended failed on P", "counters: stall_timeout 1"]
    report.finals = {"P:done": 4, "D:done": 4}
    assert report.ok and why_not_done(report) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--requests", "0"], "kvfsm demo: --requests must be at least 1, not 0"),
        (["demo", "--fabric", "sim", "--corrupt", "3"], "kvfsm demo: --corrupt: the real fabric's"),
        (["demo", "--fabric", "sim", "--model", "tiny"], "kvfsm demo: --model: the real fabric's"),
        (["demo", "--memory-mib", "0"], "kvfsm demo: --memory-mib must be above 0"),
        (["demo", "--p-block-size", "8", "--d-block-size", "12"], "kvfsm demo: --d-block-size 12"),
        (["bench", "--requests", "0"], "kvfsm bench: --requests 0: every size and count"),
    ],
)
def test_a_flag_that_cannot_apply_is_refused_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_diagrams_into_a_file_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a-file"
    target.write_text("")
    assert main(["diagrams", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfsm diagrams: cannot write there:") and "Traceback" not in err


@pytest.mark.parametrize("command", ["demo", "bench", "scenario", "check", "diagrams"])
def test_help_shows_the_defaults(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "(default:" in text or "default " in text
