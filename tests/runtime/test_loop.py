"""`EngineLoop`: engines on threads of their own over real NIXL and ZMQ, driven by events.

The loop sleeps until a submission, a finished handshake or the core's next deadline wakes it;
these tests make its fabric polling too slow to matter (30 s) wherever they check that one of
those events, and nothing else, moved a request on."""

from __future__ import annotations

import ctypes
import itertools
import queue
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvfsm.core import (
    Admit,
    Consumer,
    CoreConfig,
    Finished,
    Identity,
    Mode,
    PrefillFinished,
    Producer,
    ReportFailed,
    ReportReceived,
)
from kvfsm.fabric import NixlFabric
from kvfsm.layout import KvGeometry
from kvfsm.lifecycle import LocalProtocolError
from kvfsm.runtime import CallerOutput, Engine, EngineLoop, KvCache, RequestTrace
from kvfsm.sidechannel import HandshakeListener, LocalDirectory, ZmqDirectory, payload_of
from kvfsm.sim import check_request, request_seed, write_request

pytestmark = pytest.mark.nixl

_GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=2, block_size=4, num_blocks=64
)
_HASH, _WIRE = "loop-test", 1
_BOUND_S = 20.0  # every wait here is bounded; a working loop is done in milliseconds
_SLOW_POLL: dict[str, Any] = {"poll_min_s": 30.0, "poll_max_s": 30.0, "idle_poll_s": 30.0}
_ids = itertools.count()


class _Rank:
    """An engine, its handshake listener and its loop; outputs land in a queue."""

    def __init__(self, side: str, name: str, mode: Mode, config: CoreConfig, **loop: Any) -> None:
        core = (Producer if side == "P" else Consumer)(Identity(name), mode, config)
        self.addresses: dict[str, tuple[str, int]] = {}
        self.directory = ZmqDirectory(
            self.addresses, compat_hash=_HASH, wire_version=_WIRE, timeout_s=2.0
        )
        fabric = NixlFabric(core.identity.agent)
        self.engine = Engine(
            core, fabric, KvCache.allocate(_GEOMETRY), self.directory, time.monotonic
        )
        payload = payload_of(self.engine, compat_hash=_HASH, wire_version=_WIRE)
        self.listener = HandshakeListener({self.engine.agent: payload}.get)
        self.outputs: queue.SimpleQueue[CallerOutput] = queue.SimpleQueue()
        self.loop = EngineLoop(self.engine, self.outputs.put, **loop)
        self.directory.on_result = self.loop.wake
        self.loop.start()

    def until_finished(self, n: int) -> list[CallerOutput]:
        """Outputs up to the n-th `Finished` (and its trace)."""
        got: list[CallerOutput] = []
        deadline = time.monotonic() + _BOUND_S
        while sum(isinstance(o, RequestTrace) for o in got) < n:
            got.append(self.outputs.get(timeout=max(0.0, deadline - time.monotonic())))
        return got

    def close(self) -> None:
        self.loop.stop()
        self.listener.close()
        self.directory.close()
        self.engine.fabric.close()


@contextmanager
def _pair(
    mode: Mode, d_loop: dict[str, Any] | None = None, d_config: CoreConfig | None = None
) -> Iterator[tuple[_Rank, _Rank]]:
    n = next(_ids)
    p = _Rank("P", f"P{n}", mode, CoreConfig())
    d = _Rank("D", f"D{n}", mode, d_config or CoreConfig(), **(d_loop or {}))
    p.addresses[d.engine.agent] = ("127.0.0.1", d.listener.port)
    d.addresses[p.engine.agent] = ("127.0.0.1", p.listener.port)
    try:
        yield p, d
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_loops_move_verified_kv_submitted_from_another_thread(mode: Mode) -> None:
    with _pair(mode) as (p, d):
        p_name = p.engine.side.identity.engine_id
        for i in range(20):
            blocks = np.array([2 * i, 2 * i + 1], dtype=np.int32)
            write_request(p.engine.kv, request_seed(f"r{i}"), blocks, unit_tokens=4)
            p.loop.submit(Admit(f"r{i}-0000000a", blocks))
            p.loop.submit(PrefillFinished(f"r{i}-0000000a", blocks))
            d.loop.submit(Admit(f"r{i}-0000000b", blocks[::-1].copy(), p_name, 1, f"r{i}-0000000a"))
        got = d.until_finished(20)
        p.until_finished(20)
        for i in range(20):
            mine = [o for o in got if getattr(o, "request_id", None) == f"r{i}-0000000b"]
            assert [type(o).__name__ for o in mine] == [
                "ReportReceived",
                "Finished",
                "RequestTrace",
            ]
            assert isinstance(mine[0], ReportReceived) and isinstance(mine[1], Finished)
            assert mine[1].state == "done"
            check = check_request(
                d.engine.kv,
                request_seed(f"r{i}"),
                mine[0].blocks,
                unit_tokens=4,
                first_token=0,
                tokens=8,
            )
            assert check.wrong == 0 and check.compared == 2 * d.engine.kv.block_bytes
        assert not p.loop.errors and not d.loop.errors


def test_a_deadline_wakes_a_loop_that_would_not_poll_for_30_seconds() -> None:
    # D's handshake with P hangs; only D's watchdog can end the request, and only if the loop
    # wakes for it (its fabric polling is 30 s apart).
    config = CoreConfig(
        watchdog_s=0.2, stall_s=0.1, producer_stall_s=0.2, fence_s=0.2, heartbeat_s=0.1
    )
    directory = LocalDirectory(time.monotonic)
    directory.hang_next("P#0", seconds=120.0)
    core = Consumer(Identity("Dwatch"), "push", config)
    engine = Engine(
        core, NixlFabric("Dwatch#0"), KvCache.allocate(_GEOMETRY), directory.view(), time.monotonic
    )
    outputs: queue.SimpleQueue[CallerOutput] = queue.SimpleQueue()
    loop = EngineLoop(engine, outputs.put, **_SLOW_POLL).start()
    try:
        loop.submit(Admit("r-0000000b", np.array([1, 2], dtype=np.int32), "P", 1, ""))
        got = [outputs.get(timeout=_BOUND_S) for _ in range(4)]
        assert [type(o).__name__ for o in got] == [
            "ReportFailed",
            "ReleaseBlocks",
            "Finished",
            "RequestTrace",
        ]
        assert isinstance(got[0], ReportFailed) and got[2].state == "expired"  # type: ignore[union-attr]
    finally:
        loop.stop()
        engine.fabric.close()


def test_a_finished_handshake_wakes_the_loop() -> None:
    # D's loop polls every 30 s and its first deadline is 20 s away: only the handshake's own
    # wake-up lets it register its blocks with P now. (P's WRITE then waits for D's next poll:
    # UCX wires a connection up only as both sides progress, which is why a real loop polls
    # every millisecond or less while requests are live.)
    config = CoreConfig(
        lease_s=60, watchdog_s=40, heartbeat_s=20, fence_s=40, stall_s=30, producer_stall_s=35
    )
    with _pair("push", d_loop=_SLOW_POLL, d_config=config) as (p, d):
        rid, p_name = "h-0000000b", p.engine.side.identity.engine_id
        d.loop.submit(Admit(rid, np.array([3, 4], dtype=np.int32), p_name, 1, "")).result(_BOUND_S)
        assert d.engine.side.requests[rid].state == "allocated"  # connecting to P
        deadline = time.monotonic() + _BOUND_S
        while d.engine.side.requests[rid].state != "registered":
            assert time.monotonic() < deadline, "the handshake did not wake the loop"
            threading.Event().wait(0.01)  # no event to wait on: D's state is the observable
        assert d.loop.wakeups >= 1


def test_a_wake_that_comes_before_the_loop_sleeps_cuts_the_sleep_short() -> None:
    # The race CI once lost: the handshake finished while D's loop was still polling, so the
    # sleep that followed returned at once, and the wake went uncounted.
    engine = _lone_engine("Dearly", side="D")
    loop = EngineLoop(engine, lambda _o: None, **_SLOW_POLL)  # not started: this thread sleeps
    try:
        loop.wake()
        loop._sleep(_BOUND_S)  # returns at once; a sleep blind to the wake would last _BOUND_S
        assert loop.wakeups == 1
    finally:
        loop.stop()
        engine.fabric.close()


def test_a_callers_mistake_comes_back_in_its_future_and_the_loop_goes_on() -> None:
    with _pair("push") as (p, _d):
        blocks = np.array([1], dtype=np.int32)
        p.loop.submit(Admit("x-0000000a", blocks)).result(_BOUND_S)
        twice = p.loop.submit(Admit("x-0000000a", blocks))
        with pytest.raises(LocalProtocolError, match="x-0000000a"):
            twice.result(_BOUND_S)
        assert p.loop.call(lambda e: sorted(e.side.requests)).result(_BOUND_S) == ["x-0000000a"]
        assert p.loop.alive and not p.loop.errors


def _lone_engine(name: str, mode: Mode = "push", side: str = "P") -> Engine:
    """An engine on real NIXL with no peer and no request."""
    return Engine(
        (Producer if side == "P" else Consumer)(Identity(name), mode),
        NixlFabric(f"{name}#0"),
        KvCache.allocate(_GEOMETRY),
        LocalDirectory(time.monotonic).view(),
        time.monotonic,
    )


def test_an_idle_loop_polls_only_at_its_idle_interval() -> None:
    engine = _lone_engine("Pidle")
    loop = EngineLoop(engine, lambda _o: None, idle_poll_s=30.0).start()
    try:
        before = loop.call(lambda _e: loop.polls).result(_BOUND_S)
        threading.Event().wait(
            0.3
        )  # a window in which a polling loop would poll thousands of times
        after = loop.call(lambda _e: loop.polls).result(_BOUND_S)
        assert after == before + 1  # the one poll that followed the first call
    finally:
        loop.stop()
        engine.fabric.close()
    with pytest.raises(RuntimeError, match="has stopped"):
        loop.submit(Admit("late-0000000a", np.array([1], dtype=np.int32))).result(_BOUND_S)


def _timer_slack_ns() -> int:
    return int(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK, this thread's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is Linux's")
def test_the_loop_thread_runs_with_a_tight_timer_slack() -> None:
    # The default 50 us slack would stretch each 20 us poll interval to ~70 us.
    engine = _lone_engine("Pslack")
    loop = EngineLoop(engine, lambda _o: None).start()
    try:
        assert loop.call(lambda _e: _timer_slack_ns()).result(_BOUND_S) == 1000
        assert _timer_slack_ns() != 1000  # the loop's thread only, not its caller's
    finally:
        loop.stop()
        engine.fabric.close()


@pytest.mark.parametrize(
    ("side", "mode", "hot_s"),
    [("P", "push", 1e-3), ("P", "pull", 0.0), ("D", "push", 1e-3), ("D", "pull", 1e-3)],
)
def test_the_hot_window_is_off_only_on_a_pull_mode_producer(
    side: str, mode: Mode, hot_s: float
) -> None:
    # A pull-mode P only grants and releases; its polling took CPU from D's READs.
    engine = _lone_engine(f"{side}hot{mode}", mode, side)
    try:
        assert EngineLoop(engine, lambda _o: None).hot_s == hot_s
        assert EngineLoop(engine, lambda _o: None, hot_s=0.5).hot_s == 0.5
    finally:
        engine.close()
        engine.fabric.close()
