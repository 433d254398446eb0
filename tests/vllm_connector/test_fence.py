"""`DeviceFence` on the host: a step's events wait for the device work queued before them, keep
their order across steps, and none is lost at close. The device is a stand-in whose progress
the test sets (the VRAM test in tests/fabric/test_vram.py runs the real thing on a GPU)."""

from __future__ import annotations

import queue
import threading

import pytest

from kvfsm.vllm._fence import DeviceFence

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]


class _Point:
    """A point in the stand-in device's work: done once the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        self.done.wait()


def _fence() -> tuple[DeviceFence, list[_Point], queue.SimpleQueue[str]]:
    points: list[_Point] = []
    out: queue.SimpleQueue[str] = queue.SimpleQueue()

    def mark() -> _Point:
        points.append(_Point())
        return points[-1]

    return DeviceFence(out.put, "test", marker=mark), points, out


def test_events_wait_for_the_work_queued_before_them_and_keep_their_order() -> None:
    fence, points, out = _fence()
    fence.pass_on(["before any forward"])  # nothing queued yet: passes at once
    assert out.get(timeout=10) == "before any forward"
    fence.written()  # step 1's forward queued
    fence.pass_on(["prefill r1 finished", "abort r2"])
    fence.written()  # step 2's forward queued
    fence.pass_on(["prefill r3 finished"])
    assert out.empty()  # step 1 has not run on the device
    points[1].done.set()  # step 2 runs first (it cannot, but the fence must not rely on it)
    assert out.empty()  # order holds: step 1's events first
    points[0].done.set()
    assert [out.get(timeout=10) for _ in range(3)] == [
        "prefill r1 finished",
        "abort r2",
        "prefill r3 finished",
    ]
    fence.close()


def test_close_hands_over_what_it_holds_and_survives_a_failing_submit() -> None:
    got: list[str] = []

    def submit(event: str) -> None:
        if event == "bad":
            raise RuntimeError("the engine loop stopped")
        got.append(event)

    point = _Point()
    point.done.set()
    fence = DeviceFence(submit, "test", marker=lambda: point)
    fence.written()
    fence.pass_on(["bad", "a"])
    fence.pass_on(["b"])
    fence.close()
    assert got == ["a", "b"]
