"""`kvfsm scenario`: the scenario library passes on the simulated fabric, the runner reports what
broke (a planted bug, a wrong expectation), and malformed files are refused with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfsm.cli import main
from kvfsm.cli.scenario import ScenarioError, load_scenario, run_scenario
from kvfsm.cli.scenario._file import MAX_SCENARIO_BYTES
from kvfsm.cli.scenario._run import _Run
from kvfsm.core import Consumer, ReportReceived, Side
from kvfsm.core._records import Request

LIBRARY = Path(__file__).parents[1] / "scenarios"
FILES = sorted(LIBRARY.glob("*.toml"))
DOCS = Path(__file__).parents[2] / "docs" / "scenarios.md"


def test_library_covers_the_anchor_failures() -> None:
    """Every scenario names the failure it reproduces, and docs/scenarios.md lists every one."""
    assert len(FILES) >= 12
    listed = DOCS.read_text()
    for path in FILES:
        scenario = load_scenario(path)
        assert scenario.reference, f"{path.name} names no failure"
        assert scenario.expect, f"{path.name} expects no final state"
        assert f"`{path.name}`" in listed, f"docs/scenarios.md does not list {path.name}"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_scenario_passes_on_sim(path: Path) -> None:
    report = run_scenario(load_scenario(path), "sim")
    assert report.passed, report.violations + report.unmet
    for key, outcome in report.requests.items():
        assert outcome.trace, key
        assert all(not state.startswith("live") for state in outcome.final_state.values())


def _failed_write(tmp_path: Path, expect_d: str) -> Path:
    text = (LIBRARY / "failed_write_marks_blocks_invalid.toml").read_text()
    path = tmp_path / "edited.toml"
    path.write_text(
        text.replace('side = "D"\nstate = "failed"', f'side = "D"\nstate = "{expect_d}"')
    )
    return path


def test_wrong_expectation_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _failed_write(tmp_path, "done")
    assert main(["scenario", "--json", str(path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False
    assert report["violations"] == []
    assert report["unmet"] == ["expect[0]: r1 on D#0 is failed, expected done"]


def test_planted_bug_is_a_violation(monkeypatch: pytest.MonkeyPatch) -> None:
    """D telling its caller a failed request's blocks arrived: the run must report it."""

    def report_received(self: Consumer, req: Request) -> None:
        self._emit(ReportReceived(req.id, req.blocks))

    monkeypatch.setattr(Consumer, "_req_cmd_report_failed", report_received)
    report = run_scenario(load_scenario(LIBRARY / "failed_write_marks_blocks_invalid.toml"))
    assert not report.passed
    assert any("no silent corruption" in v for v in report.violations), report.violations


def test_json_reports_requests_and_violations(capsys: pytest.CaptureFixture[str]) -> None:
    path = LIBRARY / "d_aborts_mid_write.toml"
    assert main(["scenario", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["violations"] == [] and report["passed"] is True
    r1 = report["requests"]["r1"]
    assert r1["final_state"] == {"P#0": "failed", "D#0": "aborted"}
    d_states = [e["state"] for e in r1["trace"] if e["agent"] == "D#0"]
    assert d_states[-2:] == ["fencing", "aborted"]  # D held its blocks until the WRITE ended
    times = [e["t"] for e in r1["trace"]]
    assert times == sorted(times)


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scenario", str(LIBRARY / "write_fails_to_post.toml")]) == 0
    out = capsys.readouterr().out
    assert "write_fails_to_post" in out and "passed" in out and "fail" in out


def _scenario_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(
        'description = "x"\n' + body + '\n[[engines]]\nside = "P"\nmode = "push"\n'
        '[[engines]]\nside = "D"\nmode = "push"\n[[requests]]\nid = "r1"\n'
    )
    return path


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('timeline = [{ do = "admit", request = "r9" }]', "no request 'r9'"),
        ('timeline = [{ do = "fault", kind = "err", agent = "P#3" }]', "no agent 'P#3'"),
        ('timeline = [{ do = "fly", request = "r1" }]', "Invalid value 'fly'"),
        ('timeline = [{ do = "advance", seconds = -1 }]', "`$.timeline[0].seconds`"),
        ('timeline = [{ do = "admit", request = "r1", extra = 1 }]', "unknown field `extra`"),
        ('timeline = []\nfabrics = ["nixl"]\nnetwork = { drop_notif = 0.1 }', "faults of the"),
        ("timeline = []\nnetwork = { drop_notif = 2.0 }", "probability"),
        ("timeline = []\nnetwork = { lose_everything = 1.0 }", "unknown settings"),
        ("timeline = []\nconfig = { stall_s = 9.0, producer_stall_s = 1.0 }", "producer_stall_s"),
        ('timeline = "soon"', "Expected `array`"),
        ("timeline = [", "not valid TOML: Invalid value (at line 3"),
    ],
)
def test_malformed_scenario_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, says: str
) -> None:
    path = _scenario_file(tmp_path, body)
    with pytest.raises(ScenarioError, match=r"s\.toml") as caught:
        load_scenario(path)
    assert says in str(caught.value)
    assert main(["scenario", str(path)]) == 2
    assert says in capsys.readouterr().err


def test_engines_must_pair_one_p_with_one_d(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        'description = "x"\ntimeline = []\n[[engines]]\nside = "P"\nmode = "push"\n'
        '[[engines]]\nside = "D"\nmode = "pull"\nblock_size = 6\n[[requests]]\nid = "r1"\n'
    )
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert "same mode" in str(caught.value) and "multiple of P's" in str(caught.value)


def test_unreadable_and_oversized_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.toml")
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * MAX_SCENARIO_BYTES)
    with pytest.raises(ScenarioError, match="larger than"):
        load_scenario(big)


def test_sim_only_scenario_refused_on_nixl(capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing runs on the fabric asked for: bad input.
    assert main(["scenario", "--fabric", "nixl", str(LIBRARY / "write_fails_to_post.toml")]) == 2
    captured = capsys.readouterr()
    assert (
        "write_fails_to_post: skipped: it runs on sim (its `fabrics`; default sim)" in captured.err
    )
    assert "kvfsm scenario: 0 passed, 0 failed, 1 skipped" in captured.out


def test_many_files_run_every_one_and_count_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A glob runs every file: a failing one does not stop the rest, the summary counts each,
    and the exit code says a file failed."""
    files = [LIBRARY / "write_fails_to_post.toml", _failed_write(tmp_path, "done")]
    files.append(LIBRARY / "failed_write_marks_blocks_invalid.toml")
    assert main(["scenario", "--json", *map(str, files)]) == 1
    captured = capsys.readouterr()
    assert [json.loads(line)["passed"] for line in captured.out.splitlines()] == [1, 0, 1]
    assert "kvfsm scenario: 2 passed, 1 failed, 0 skipped" in captured.err


def test_an_unknown_expected_state_is_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _failed_write(tmp_path, "faild")
    assert main(["scenario", str(path)]) == 2
    assert "expect[0]: no state 'faild' (states: aborted, absent," in capsys.readouterr().err


def test_a_core_that_raises_is_reported_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The soak's finding of 2026-11-23, undone: a withdrawn request left waiting on its peer.
    The core contains its own protocol error (the request is given up safely) and the run
    reports it as a finding."""
    monkeypatch.setattr(Side, "_stop_waiting", lambda self, req: None)
    report = run_scenario(load_scenario(LIBRARY / "d_withdraws_while_p_connects_back.toml"))
    assert not report.passed
    found = [v for v in report.violations if v.startswith("internal error on P#0")]
    assert found and "kvfsm's fault" in found[0], report.violations
    assert report.requests["r1"].trace  # what led there is still reported


@pytest.mark.parametrize(("cached", "d_blocks"), [(0, 2), (1, 2), (2, 1), (3, 1), (4, 0), (9, 0)])
def test_cached_counts_p_blocks(tmp_path: Path, cached: int, d_blocks: int) -> None:
    """`cached` is in P blocks, as docs/scenarios.md says: with D's blocks twice P's, a prompt
    of 4 P blocks fills 2 D blocks, and D's hit is the whole D blocks the cached ones fill."""
    path = tmp_path / "s.toml"
    path.write_text(
        'description = "x"\ntimeline = [{ do = "admit", request = "r" }]\n'
        '[[engines]]\nside = "P"\nmode = "push"\nblock_size = 4\n'
        '[[engines]]\nside = "D"\nmode = "push"\nblock_size = 8\n'
        f'[[requests]]\nid = "r"\nblocks = 4\ncached = {cached}\n'
        '[[expect]]\nrequest = "r"\nside = "D"\nstate = "done"\n'
    )
    run = _Run(load_scenario(path), "sim")
    run.timeline()
    assert len(run.cluster.requests["r"].d_blocks) == d_blocks  # the D blocks D still needs
    run.finish()
    run.cluster.close()
    report = run.report()
    assert report.passed, report.violations + report.unmet
    assert "cached = 0          # D's prefix-cache hit, in P blocks" in DOCS.read_text()
