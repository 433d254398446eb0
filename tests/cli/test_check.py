"""`kvfsm check`: the bounded exhaustive exploration finds nothing wrong in the core at depth 6
(the default bound, 9, is CI's `make check` and `make test-slow`'s), explores one request's
whole space to its end, catches a planted protocol bug with a shortest trace, finds exactly the same with worker
processes as without, and its command line reports the figures and the violations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, cast

import msgspec
import pytest

from kvfsm.cli import main
from kvfsm.cli.check import MAX_DEPTH, run_check
from kvfsm.core import Consumer

_TEST_DEPTH = 6
"""The bound `make test` explores: every action and fault kind of the default bound
(`MAX_DEPTH`: `make check`, which CI runs, and `make test-slow`), on paths three actions
shorter."""
# States per mode at 2 requests and 2 faults: about 2,500-3,000 at depth 6, 9,000-10,000 at depth 7,
# 95,000-125,000 at depth 9. The
# floors are well below, so the core may grow or shrink a little; far above what a broken
# explorer (an action or fault kind never tried, a fingerprint merging everything) would reach.
_AT_LEAST = {_TEST_DEPTH: 1_500, MAX_DEPTH: 30_000}


@pytest.mark.parametrize(
    "depth", [_TEST_DEPTH, pytest.param(MAX_DEPTH, marks=pytest.mark.slow, id="default")]
)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_bound_finds_no_violation(mode: str, depth: int) -> None:
    report = run_check(mode, max_depth=depth, workers=2)  # type: ignore[arg-type]
    assert report.violations == [], report.violations[:3]
    assert report.states_explored > _AT_LEAST[depth]
    assert report.transitions > report.states_explored  # duplicates were met and merged
    assert report.max_depth == report.depth_bound == depth
    assert report.paths > 0 and report.violating_transitions == 0


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_one_request_without_faults_is_explored_to_the_end(mode: str) -> None:
    """No depth bound in effect: every path ends by itself (all ended, nothing due)."""
    report = run_check(mode, max_faults=0, requests=1, max_depth=200)  # type: ignore[arg-type]
    assert report.violations == []
    assert report.paths_cut == 0 and report.paths > 0
    assert report.states_explored > 100 and report.max_depth < 200


def _failure_taken_for_completion(self: Consumer, msg: Any, sender: str) -> None:
    """The planted bug: D takes P's Failure notice for a completion of the transfer."""
    req = self._request_from(msg.request_id, sender, "failure")
    if req is not None:
        self._result_from_peer(req, sender, True)


def test_planted_bug_is_caught_with_a_shortest_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Consumer, "_on_failure", _failure_taken_for_completion)
    report = run_check("push", max_faults=0, requests=1, max_depth=12)
    assert report.violations and report.violating_transitions > 0
    first = report.violations[0]
    assert any("no silent corruption" in p for p in first.problems)
    # admit, abort on P, then the clock: D connects, registers, P connects back, the Failure lands.
    assert len(first.trace) <= 8
    assert first.trace[0].startswith("admit r1")
    assert any("Failure of r1" in step for step in first.trace)


def _figures(report: Any) -> dict[str, Any]:
    """A report without its wall time."""
    return {k: v for k, v in msgspec.to_builtins(report).items() if k != "elapsed_s"}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_workers_find_exactly_what_one_process_finds(mode: str) -> None:
    bound = {"max_faults": 2, "requests": 2, "max_depth": 5}
    alone = run_check(mode, **bound)  # type: ignore[arg-type]
    assert alone.states_explored > 500 and alone.paths_cut > 0
    assert _figures(run_check(mode, workers=2, **bound)) == _figures(alone)  # type: ignore[arg-type]


def test_workers_report_the_same_violations_and_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two planted bugs at once: the workers (forked: the patches reach them) find the same
    problems, counted the same, with the same shortest traces."""
    monkeypatch.setattr(Consumer, "_on_failure", _failure_taken_for_completion)
    monkeypatch.setattr(Consumer, "_may_still_land", lambda self, req: False)
    alone = run_check("push", max_faults=1, requests=1, max_depth=9)
    assert len(alone.violations) == 2 and alone.violating_transitions > 2
    assert _figures(run_check("push", max_faults=1, requests=1, max_depth=9, workers=2)) == (
        _figures(alone)
    )


# Two requests admitted, each aborted on P while D still holds it: two aborts spent, which a
# set would keep in an order that depends on the process's hash seed.
_TWO_ABORTS = (
    ("admit", "r1", "D"),
    ("admit", "r2", "D"),
    ("abort", "r1", "P"),
    ("abort", "r2", "P"),
)
_DIGEST = """
from kvfsm.cli.check._replay import _Run
from kvfsm.cli.check._state import fingerprint
run = _Run("pull", {{}}, set())
for action in {path!r}:
    run.apply(action)
print(fingerprint(run.cluster, run.faults, frozenset(run.spent)).hex())
"""


def test_a_state_has_one_digest_in_every_process() -> None:
    """The search keeps digests, so a state's fingerprint must not depend on the process: it
    holds only plain values in a canonical order (no sets), and processes with other hash seeds
    (spawned workers, another run) compute the same digest."""
    from kvfsm.cli.check._replay import _Run
    from kvfsm.cli.check._state import fingerprint, state_print

    run = _Run("pull", {}, set())
    for action in _TWO_ABORTS:
        run.apply(action)
    printed = cast(tuple[Any, ...], state_print(run.cluster, run.faults, frozenset(run.spent)))
    assert printed[-1] == (("abort", "r1", "P"), ("abort", "r2", "P"))  # both spent, in order

    def plain(value: Any) -> bool:
        if isinstance(value, tuple):
            return all(map(plain, value))
        return value is None or isinstance(value, str | int | float)

    assert plain(printed)
    here = fingerprint(run.cluster, run.faults, frozenset(run.spent)).hex()
    script = _DIGEST.format(path=_TWO_ABORTS)
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == here


_NIXL_GARBAGE_THEN_WORKERS = """
import gc
import time
import numpy as np
import kvfsm.cli.check._search as search
from kvfsm.fabric import NixlFabric

gc.disable()  # the garbage below stays for the workers to inherit
a, b = NixlFabric("gc-A"), NixlFabric("gc-B")
src, dst = np.arange(16384, dtype=np.uint8), np.zeros(16384, dtype=np.uint8)
a.register_memory(src)
b.register_memory(dst)
a.add_remote_agent(b.get_agent_metadata())
b.add_remote_agent(a.get_agent_metadata())
rows = [np.array([[x.ctypes.data, x.nbytes, 0]], dtype=np.int64) for x in (src, dst)]
one = np.zeros(1, dtype=np.int64)
local, remote = a.prep_xfer_dlist(None, rows[0]), a.prep_xfer_dlist(b.agent_name, rows[1])
handle = a.make_prepped_xfer("WRITE", local, one, remote, one, b"w")
state, end = a.transfer(handle), time.monotonic() + 60
while state == "PROC" and time.monotonic() < end:  # UCX opens its endpoints (TCP, loopback)
    state = a.check_xfer_state(handle)
    b.get_new_notifs()
assert state == "DONE", state
cycle = [a, b, src, dst]
cycle.append(cycle)
del a, b, src, dst, cycle, local, remote, handle  # garbage a collection would finalise

start = search._start_worker
def start_and_collect(mode, report):  # what a worker's collector does sooner or later
    start(mode, report)
    gc.collect()
search._start_worker = start_and_collect  # forked workers run it as patched here

assert search.run_check("push", max_faults=0, requests=1, max_depth=3, workers=2).paths > 0
gc.enable()
gc.collect()  # the agents close here, in the process that owns them
print("survived")
"""


@pytest.mark.nixl
def test_workers_leave_a_nixl_agent_they_inherited_alone() -> None:
    """Workers are forked: had one finalised a NIXL agent it inherited as garbage (a test run in
    the same process leaves some), it would have torn down UCX endpoints whose epoll set the
    parent shares, and the parent aborted when it collected the agent itself (UCX: "unable to
    modify event set"). Seen when the suite ran on two xdist workers."""
    out = subprocess.run(
        [sys.executable, "-c", _NIXL_GARBAGE_THEN_WORKERS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
    )
    assert out.returncode == 0 and out.stdout.strip() == "survived", out.stderr[-2000:]


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="workers >= 1"):
        run_check("push", workers=0)
    assert main(["check", "--workers", "0"]) == 2


def test_cli_json_as_a_user_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["check", "--mode", "both", "--requests", "1", "--faults", "1", "--depth", "5"]
    argv += ["--workers", "2"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["violations"] == []
    assert set(out["modes"]) == {"push", "pull"}
    modes = out["modes"].values()
    assert out["states_explored"] == sum(m["states_explored"] for m in modes) > 0
    assert all(m["max_faults"] == 1 and m["depth_bound"] == 5 for m in modes)


def test_cli_reports_a_violation_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(Consumer, "_on_failure", _failure_taken_for_completion)
    argv = ["check", "--mode", "push", "--requests", "1", "--faults", "0", "--depth", "8"]
    assert main([*argv, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["violations"] and out["violations"][0]["mode"] == "push"
    assert out["violations"][0]["trace"][0].startswith("admit r1")
    assert main(argv) == 1  # the table, then each violation with its numbered trace
    text = capsys.readouterr().out
    assert "kvfsm check: push" in text and "violation (push)" in text and " 1. admit r1" in text


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_blocks_handed_back_under_late_bytes_are_caught(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planted bug: D hands back the blocks of a request it gave up on at once, though a
    released transfer's bytes may still land in them (`LATE_S` later: UCX over TCP)."""
    monkeypatch.setattr(Consumer, "_may_still_land", lambda self, req: False)
    report = run_check(mode, max_faults=1, requests=1, max_depth=9)  # type: ignore[arg-type]
    first = report.violations[0]
    assert any("with bytes still due" in p for p in first.problems), first.problems
    # The transfer was given up while it moved: stuck, then released by a timeout.
    assert any(step.startswith("fault: stuck the") for step in first.trace)
