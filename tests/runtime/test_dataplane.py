"""The data plane: `ThreadedPlane` runs every fabric call on a thread of its own and reports
what happened as results; `InlinePlane` does the same on the caller's thread.

On the simulated fabric, which never progresses on its own (a transfer with latency stays
"PROC" until the test advances the clock), so nothing here depends on timing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvfsm.fabric import Fabric, NotFoundError, XferHandle
from kvfsm.runtime._dataplane import (
    InlinePlane,
    NotificationsDrained,
    NotifySent,
    PlaneFault,
    PlaneResult,
    ThreadedPlane,
    TransferEnded,
)
from kvfsm.runtime._pacing import Backoff
from tests.fabric.sim_pair import Pair, descs, make_pair
from tests.runtime.fabric_threads import ThreadRecorder

_BOUND_S = 10.0
_PLANE = "plane-under-test"


class _Results:
    """What a plane delivered, and an event set whenever its thread says results wait."""

    def __init__(self) -> None:
        self.got: list[PlaneResult] = []
        self.waiting = threading.Event()

    def wait_for(self, plane: ThreadedPlane, done: Callable[[], bool]) -> None:
        """Take results until `done()` holds (bounded)."""
        while not done():
            assert self.waiting.wait(_BOUND_S), f"no result came: {self.got}"
            self.waiting.clear()
            plane.progress()


@pytest.fixture
def pair() -> Pair:
    return make_pair(transfer_latency=1.0)  # posts stay "PROC": the test advances no clock


@pytest.fixture
def plane(pair: Pair) -> Iterator[tuple[ThreadedPlane, _Results, ThreadRecorder]]:
    results = _Results()
    recorder = ThreadRecorder(pair.a)
    plane = ThreadedPlane(recorder, results.got.append, _PLANE)
    plane.start(results.waiting.set, Backoff(1e-4, 1e-3, 0.0), 1e-3)
    try:
        yield plane, results, recorder
    finally:
        plane.close()


def _xfers(fabric: Any) -> int:
    return int(fabric.open_resources()["xfers"])


def _make(pair: Pair) -> Callable[[Fabric], XferHandle]:
    local = pair.a.prep_xfer_dlist(None, descs(pair.abuf, [(0, 16)]))
    remote = pair.a.prep_xfer_dlist("b", descs(pair.bbuf, [(0, 16)]))
    rows = np.arange(1, dtype=np.int64)
    return lambda fabric: fabric.make_prepped_xfer("WRITE", local, rows, remote, rows, b"done")


def test_every_fabric_call_runs_on_the_plane_thread(
    pair: Pair, plane: tuple[ThreadedPlane, _Results, ThreadRecorder]
) -> None:
    threaded, results, recorder = plane
    make = _make(pair)
    assert threaded.post(1, make) is None  # the handle stays on the plane's thread
    threaded.send("b", b"hello", "r1", None)
    assert threaded.run(_xfers) == 1
    results.wait_for(threaded, lambda: any(isinstance(r, NotifySent) for r in results.got))
    threaded.cancel(1)
    assert recorder.threads == {_PLANE}
    assert threaded.turns > 0


def test_a_cancel_returns_once_the_transfer_is_released_and_nothing_follows(
    pair: Pair, plane: tuple[ThreadedPlane, _Results, ThreadRecorder]
) -> None:
    threaded, results, _ = plane
    threaded.post(7, _make(pair))
    threaded.cancel(7)
    assert threaded.run(_xfers) == 0
    threaded.send("b", b"after", "r", None)  # a later result: everything before it was reported
    results.wait_for(threaded, lambda: bool(results.got))
    assert not [r for r in results.got if isinstance(r, TransferEnded)]


def test_a_refused_post_comes_back_as_a_result_not_an_exception(
    plane: tuple[ThreadedPlane, _Results, ThreadRecorder],
) -> None:
    threaded, results, _ = plane
    row = np.zeros(1, dtype=np.int64)
    threaded.post(3, lambda fabric: fabric.make_prepped_xfer("WRITE", 999, row, 998, row, b""))
    results.wait_for(threaded, lambda: bool(results.got))
    (ended,) = results.got
    assert isinstance(ended, TransferEnded)
    assert (ended.transfer_id, ended.ok, ended.posted) == (3, False, False)
    assert "unknown" in ended.why


def test_an_exception_in_a_call_reaches_its_caller_and_the_plane_goes_on(
    plane: tuple[ThreadedPlane, _Results, ThreadRecorder],
) -> None:
    threaded, _, _ = plane

    def bad(fabric: Fabric) -> None:
        fabric.release_dlist_handle(12345)

    with pytest.raises(NotFoundError):
        threaded.run(bad)
    assert threaded.run(lambda fabric: fabric.agent_name) == "a"


def test_notifications_are_drained_on_the_plane_thread(pair: Pair) -> None:
    results = _Results()
    recorder = ThreadRecorder(pair.b)
    plane = ThreadedPlane(recorder, results.got.append, _PLANE)
    pair.a.send_notif("b", b"registration")
    pair.net.run_until_idle()  # delivered to b's inbox before b's plane starts
    plane.start(results.waiting.set, Backoff(1e-4, 1e-3, 0.0), 1e-3)
    try:
        results.wait_for(plane, lambda: bool(results.got))
    finally:
        plane.close()
    assert results.got == [NotificationsDrained({"a": [b"registration"]}, False)]
    assert recorder.threads == {_PLANE}


def test_a_stopped_plane_refuses_new_work_clearly(pair: Pair) -> None:
    plane = ThreadedPlane(pair.a, lambda _r: None, _PLANE)
    plane.start(lambda: None, Backoff(1e-4, 1e-3, 0.0), 1e-3)
    plane.post(1, _make(pair))
    plane.close()
    assert pair.a.open_resources()["xfers"] == 0  # what was in flight is released at close
    with pytest.raises(RuntimeError, match="not running"):
        plane.post(2, _make(pair))


def test_the_inline_plane_reports_on_the_callers_thread_at_once() -> None:
    instant = make_pair()  # no latency: the post completes inside the call
    got: list[PlaneResult] = []
    inline = InlinePlane(instant.a, got.append)
    handle = inline.post(1, _make(instant))
    assert handle is not None and len(got) == 1
    assert isinstance(got[0], TransferEnded) and got[0].ok and got[0].posted
    assert instant.bbuf[:16].tolist() == instant.abuf[:16].tolist()


def test_a_bug_on_the_plane_thread_fails_its_transfer_and_the_thread_goes_on(
    plane: tuple[ThreadedPlane, _Results, ThreadRecorder],
) -> None:
    threaded, results, _ = plane

    def broken(_fabric: Fabric) -> XferHandle:
        raise ZeroDivisionError("a bug")

    threaded.post(4, broken)
    results.wait_for(threaded, lambda: len(results.got) >= 2)
    ended, fault = results.got
    assert isinstance(ended, TransferEnded) and not ended.ok and "a bug" in ended.why
    assert isinstance(fault, PlaneFault) and "ZeroDivisionError" in fault.detail
    assert threaded.run(lambda fabric: fabric.agent_name) == "a"
