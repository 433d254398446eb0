"""No silent error, no lost command: a guard or command that raises mid-event, or a command the
runtime fails to carry out, abandons only the requests it hit, safely: D reports its blocks
invalid, every block goes back exactly once (after the hold that keeps late bytes out), the
commands already emitted are kept, an `InternalError` says what happened, and the engine goes on
serving the others.

The helpers are test_core.py's."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvfsm.core import (
    CommandFailed,
    Consumer,
    InternalError,
    Mode,
    PostTransfer,
    Producer,
    ReleaseBlocks,
    ReportFailed,
    Side,
)
from kvfsm.runtime import Engine, EngineLoop
from kvfsm.sim import Cluster
from tests.core.fixtures import MODES, Outputs, settled


def _plant(
    monkeypatch: pytest.MonkeyPatch, cls: type[Side], name: str, *, after: bool
) -> list[int]:
    """Make `cls.<name>` raise on its first call (after doing its work, with `after`); returns
    the list its calls are counted in."""
    original: Callable[..., Any] = getattr(cls, name)
    calls: list[int] = []

    def planted(self: Side, *args: Any) -> Any:
        calls.append(1)
        result = original(self, *args) if after or len(calls) > 1 else None
        if len(calls) == 1:
            raise RuntimeError(f"planted bug in {name}")
        return result

    monkeypatch.setattr(cls, name, planted)
    return calls


def _serve_next(cluster: Cluster) -> None:
    """The engines go on: the next request is served with every byte checked."""
    nxt = cluster.admit("next", 4)
    cluster.finish_prefill("next")
    settled(cluster)
    assert set(nxt.final.values()) == {"done"}


def _abandoned(cluster: Cluster, out: Outputs, agent: str, rid: str) -> None:
    cluster.settle()
    errors = [o for _, a, o in out.log if a == agent and isinstance(o, InternalError)]
    assert errors and "planted bug" in errors[0].trace and rid in errors[0].request_ids
    assert cluster.ledger.violations == []  # safety held: no leak, no early free, no late write
    assert [e.split(":")[0] for e in cluster.ledger.internal_errors] == [
        f"internal error on {agent}"
    ]
    cluster.ledger.internal_errors.clear()  # found, contained: the rest must be clean
    assert len(out.releases(agent, rid)) == 1


BUGS = [  # (mode, side's class, command, after): a command of a live request raises
    ("push", Producer, "_req_cmd_post_transfer", False),
    ("pull", Producer, "_req_cmd_grant_read", False),
    ("push", Consumer, "_req_cmd_send_registration", True),
    ("pull", Consumer, "_req_cmd_post_transfer", False),
    ("push", Producer, "_req_cmd_arm_stall", True),
    ("pull", Consumer, "_req_cmd_arm_stall", True),
]


@pytest.mark.parametrize(("mode", "cls", "name", "after"), BUGS)
def test_a_raising_command_abandons_its_request_and_the_engine_goes_on(
    monkeypatch: pytest.MonkeyPatch, mode: Mode, cls: type[Side], name: str, after: bool
) -> None:
    calls = _plant(monkeypatch, cls, name, after=after)
    cluster = Cluster(mode)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    agent = "P#0" if cls is Producer else "D#0"
    _abandoned(cluster, out, agent, pr.p_id if agent == "P#0" else pr.d_id)
    assert calls, "the planted command never ran"
    assert pr.final[agent] == "failed"
    assert out.of("D#0", pr.d_id, ReportFailed)  # D never reports success for it
    _serve_next(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_a_release_emitted_before_the_bug_is_kept_and_not_repeated(
    monkeypatch: pytest.MonkeyPatch, mode: Mode
) -> None:
    """D's failure path releases its blocks, then the step raises: the release stands (it is
    not lost with the step) and abandoning does not release them a second time."""
    _plant(monkeypatch, Consumer, "_req_cmd_release_blocks", after=True)
    cluster = Cluster(mode)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r", without_blocks=True)  # P has no KV: D fails the request
    _abandoned(cluster, out, "D#0", pr.d_id)
    assert pr.final["D#0"] == "failed" and len(out.of("D#0", pr.d_id, ReportFailed)) == 1
    _serve_next(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_a_command_the_runtime_cannot_carry_out_abandons_its_request(
    monkeypatch: pytest.MonkeyPatch, mode: Mode
) -> None:
    original = Engine._post
    posts: list[PostTransfer] = []

    def broken_once(self: Engine, cmd: PostTransfer) -> None:
        posts.append(cmd)
        if len(posts) == 1:
            raise KeyError("planted bug in the runtime")
        original(self, cmd)

    monkeypatch.setattr(Engine, "_post", broken_once)
    cluster = Cluster(mode)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    poster = "P#0" if mode == "push" else "D#0"
    _abandoned(cluster, out, poster, pr.p_id if poster == "P#0" else pr.d_id)
    assert cluster.engines[poster].counters["internal_error"] == 1
    assert out.of("D#0", pr.d_id, ReportFailed)
    _serve_next(cluster)


def test_a_command_failure_for_an_ended_request_is_counted_late() -> None:
    cluster = Cluster("push")
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    settled(cluster)
    d = cluster.engines["D#0"]
    d.submit(CommandFailed(pr.d_id, "too late"))
    assert d.side.counters["late"] >= 1 and not d.take_outputs()


def test_the_loop_logs_and_counts_every_error(caplog: pytest.LogCaptureFixture) -> None:
    """A contained bug and an exception from polling are logged, counted and passed on; one
    from `on_output` is logged and counted."""
    cluster = Cluster("push")
    engine = cluster.engines["D#0"]
    seen: list[object] = []
    all_seen = threading.Event()

    def on_output(output: object) -> None:
        seen.append(output)
        if sum(isinstance(o, InternalError) for o in seen) == 2 and len(seen) >= 3:
            all_seen.set()
        if isinstance(output, ReleaseBlocks):
            raise ValueError("the caller's callback broke")

    loop = EngineLoop(engine, on_output, logger=logging.getLogger("kvfsm.test"))
    engine.outputs.append(InternalError("D: planted", ("r",), "Traceback: planted\n"))
    engine.outputs.append(ReleaseBlocks("r", np.array([1], dtype=np.int32)))
    polls = engine.poll

    def poll_raises_once() -> bool:
        engine.poll = polls  # type: ignore[method-assign]
        raise OSError("planted poll bug")

    engine.poll = poll_raises_once  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="kvfsm.test"):
        loop.start()
        assert all_seen.wait(10.0)
        loop.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert any("D: planted" in m and "Traceback: planted" in m for m in messages)
    assert any("the caller's callback broke" in m for m in messages)
    assert any("planted poll bug" in m for m in messages)
    assert loop.error_count == 3 and len(loop.errors) == 3
