"""`EngineLoop`: an engine on a thread of its own, the one thread that calls its fabric.

NIXL is not thread-safe, so every fabric call happens on this thread; other threads hand it
events. It sleeps until something can happen, and is woken by what can wake it:

* an event submitted by the caller (`submit`, `call`);
* a finished handshake (a directory with an `on_result` hook is wired to `wake`);
* the core's next deadline, heartbeat or expiry (`Engine.next_wakeup`).

NIXL (1.5.1) offers nothing to wait on for arriving notifications or finished transfers (its
progress thread busy-polls a core), so while requests are live or transfers in flight the loop
also polls the fabric: every `poll_min_s` while something happened in the last `hot_s` (a
hand-off's next message follows its last one within microseconds), then backing off (doubling
up to `poll_max_s`) while nothing happens. `hot_s` defaults to 1 ms, except on a pull-mode P
(0): there P only grants and releases, and its polling took CPU from D's READs (measured:
docs/runtime.md). With no request live it still drains notifications every `idle_poll_s`: a
peer it has never met may write at any time (a D's registration reaches P's agent before P
knows D, e.g. for a request P already let go).
While its own transfers are in flight it polls every `poll_min_s` without backing off: UCX
moves a transfer's bytes (rendezvous, shared memory) only inside the poster's progress calls.
On Linux the loop's thread asks for a timer slack of 1 us (the default 50 us would stretch every
short poll interval several times over).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from kvfsm.core import Event, InternalError, Shutdown, TransferStatus, short_trace
from kvfsm.runtime._engine import CallerOutput, Engine
from kvfsm.runtime._handshake import StatusQuery

__all__ = ["EngineLoop", "LoopCalls", "status_answerer"]

T = TypeVar("T")
_MAX_ERRORS_KEPT = 16
_PR_SET_TIMERSLACK = 29
_TIMER_SLACK_NS = 1000
_HOT_S = 1e-3


class EngineLoop:
    """Runs `engine` on its own thread; see the module docstring for when it wakes.

    `on_output` receives each caller output (blocks released, received, failed, finished,
    traces, contained bugs) on the loop's thread, in order; it must be quick and must not call
    the engine. No error is silent: every bug the engine contained (`InternalError`) and every
    exception the loop catches (from polling, from `on_output`, at close) is logged on `logger`
    (``kvfsm``; the connector passes ``vllm.kvfsm``), counted in `error_count` and kept in
    `errors` (the last 16); the loop goes on serving the other requests. Those from polling
    reach `on_output` as an `InternalError` too, for the caller's stats.
    """

    def __init__(
        self,
        engine: Engine,
        on_output: Callable[[CallerOutput], None],
        *,
        poll_min_s: float = 20e-6,
        poll_max_s: float = 1e-3,
        hot_s: float | None = None,
        idle_poll_s: float = 0.05,
        name: str | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        hot_s = _default_hot_s(engine) if hot_s is None else hot_s
        if not 0 < poll_min_s <= poll_max_s or idle_poll_s <= 0 or hot_s < 0:
            raise ValueError("need 0 < poll_min_s <= poll_max_s, hot_s >= 0 and idle_poll_s > 0")
        self.engine = engine
        self.on_output = on_output
        self.errors: deque[str] = deque(maxlen=_MAX_ERRORS_KEPT)
        self.error_count = 0
        """Errors logged since the start: contained bugs and exceptions the loop caught."""
        self._log = logger or logging.getLogger("kvfsm")
        self.wakeups = 0
        """Sleeps cut short by a call: `wake`, `submit`/`call` or `stop`."""
        self.polls = 0
        self._poll_min, self._poll_max, self._idle = poll_min_s, poll_max_s, idle_poll_s
        self.hot_s = hot_s
        """Seconds of polling every `poll_min_s` after the last activity."""
        self._cond = threading.Condition()
        self._inbox: list[tuple[Callable[[Engine], Any], Future[Any]]] = []  # guarded by _cond
        self._woken = False  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._drain_until: float | None = None  # guarded by _cond
        self._thread = threading.Thread(
            target=self._run, name=name or f"kvfsm-engine-{engine.agent}", daemon=True
        )

    # --- from any thread -------------------------------------------------------------------------

    def start(self) -> EngineLoop:
        """Start the loop's thread."""
        self._thread.start()
        return self

    def submit(self, event: Event) -> Future[None]:
        """Feed `event` to the engine on the loop's thread; the future ends when it was handled
        (with the exception, e.g. a caller's protocol error, if handling it raised)."""
        return self.call(lambda engine: engine.submit(event))

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run `fn(engine)` on the loop's thread; its result or exception ends the future."""
        future: Future[T] = Future()
        with self._cond:
            if self._stopping:
                future.set_exception(RuntimeError(f"the loop of {self.engine.agent} has stopped"))
                return future
            self._inbox.append((fn, future))
            self._cond.notify()
        return future

    def wake(self) -> None:
        """Make the loop poll now (e.g. a handshake finished)."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    def stop(self, drain_s: float = 0.0, timeout: float | None = 30.0) -> None:
        """Stop the loop and close the engine on its thread. With `drain_s`, shut the core down
        first and let requests end (at most `drain_s` seconds). Idempotent."""
        if drain_s > 0 and self._thread.is_alive():
            self.submit(Shutdown())
        with self._cond:
            self._stopping = True
            self._drain_until = self.engine.clock() + drain_s
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the loop of {self.engine.agent} did not stop in {timeout}s")
        elif not self._thread.ident:
            self.engine.close()  # never started: nothing else touches the fabric

    @property
    def alive(self) -> bool:
        """The loop's thread runs."""
        return self._thread.is_alive()

    # --- the loop's thread -------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = _Backoff(self._poll_min, self._poll_max, self.hot_s)
        _tighten_timer_slack()
        try:
            while True:
                with self._cond:
                    inbox, self._inbox = self._inbox, []
                    self._woken = False
                    stopping, drain_until = self._stopping, self._drain_until
                for fn, future in inbox:
                    self._apply(fn, future)
                active = self._poll()
                if stopping and (not self.engine.busy or self.engine.clock() >= (drain_until or 0)):
                    return
                # Its own transfers in flight count as activity: each ends within microseconds
                # to milliseconds, and only its polls progress it.
                activity = bool(active or inbox or self.engine.inflight)
                self._sleep(self._timeout(backoff.next(activity, time.monotonic())))
        finally:
            self._close()

    def _apply(self, fn: Callable[[Engine], Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(self.engine))
        except BaseException as exc:
            future.set_exception(exc)
        self._deliver()

    def _poll(self) -> bool:
        self.polls += 1
        try:
            active = self.engine.poll()
        except Exception as exc:  # a bug: keep serving the other requests, say what happened
            trace = short_trace(exc)
            self.engine.outputs.append(InternalError(f"loop: poll raised {exc!r}", (), trace))
            active = True
        self._deliver()
        return active

    def _deliver(self) -> None:
        for output in self.engine.take_outputs():
            if isinstance(output, InternalError):
                self._error(output.detail, output.trace)
            try:
                self.on_output(output)
            except Exception as exc:
                self._error(f"on_output raised {exc!r}", short_trace(exc))

    def _error(self, what: str, trace: str) -> None:
        self.error_count += 1
        self.errors.append(what)
        self._log.error("kvfsm %s: %s\n%s", self.engine.agent, what, trace.rstrip())

    def _timeout(self, delay: float) -> float:
        """How long to sleep: until the next poll (`delay`, or the idle drain's interval when
        nothing is live) or the next deadline, whichever comes first. Once per loop turn, so
        without building a list."""
        engine = self.engine
        wait = delay if engine.busy else self._idle
        at = engine.next_wakeup()
        return wait if at is None else min(wait, max(0.0, at - engine.clock()))

    def _sleep(self, timeout: float) -> None:
        with self._cond:
            if not self._called():
                self._cond.wait(timeout)
            # A call that came before the sleep began cuts it short as much as one during it.
            if self._called():
                self.wakeups += 1

    def _called(self) -> bool:
        return bool(self._inbox or self._woken or self._stopping)  # guarded by _cond

    def _close(self) -> None:
        with self._cond:
            self._stopping = True
            leftover, self._inbox = self._inbox, []
        for _, future in leftover:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(f"the loop of {self.engine.agent} has stopped"))
        try:
            self.engine.close()
        except Exception as exc:
            self._error(f"close raised {exc!r}", short_trace(exc))
        self._deliver()  # blocks the engine still held go back on close


class LoopCalls(Protocol):
    """A loop that runs functions on the thread driving its engine (`EngineLoop.call`)."""

    def call(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run `fn(engine)` on the loop's thread."""
        ...


def status_answerer(
    loop: LoopCalls, timeout_s: float = 0.5
) -> Callable[[StatusQuery], TransferStatus]:
    """How a side-channel listener answers peers' questions about `loop`'s engine's transfers:
    on the loop's thread (the core's state is that thread's), waited for at most `timeout_s`;
    a loop too busy or stopped leaves the question "unanswered"."""

    def answer(query: StatusQuery) -> TransferStatus:
        try:
            status: TransferStatus = loop.call(lambda engine: engine.transfer_status(query)).result(
                timeout_s
            )
        except Exception:  # timed out, stopped, or the engine raised: no answer, no guess
            return "unanswered"
        return status

    return answer


def _default_hot_s(engine: Engine) -> float:
    """The loop's hot window for `engine`: 1 ms, or 0 for a P in pull mode."""
    side = engine.side
    return 0.0 if side.side == "P" and side.mode == "pull" else _HOT_S


class _Backoff:
    """The loop's poll interval: `poll_min_s` after activity and for `hot_s` after the last
    one, then doubling up to `poll_max_s`."""

    def __init__(self, poll_min_s: float, poll_max_s: float, hot_s: float) -> None:
        self.poll_min, self.poll_max, self.hot = poll_min_s, poll_max_s, hot_s
        self.delay = poll_min_s
        self._last_activity: float | None = None

    def next(self, activity: bool, now: float) -> float:
        """The interval until the next poll, after a poll at `now` that found `activity`."""
        if activity:
            self._last_activity = now
        last = self._last_activity
        if last is not None and now - last <= self.hot:
            self.delay = self.poll_min
        else:
            self.delay = min(2 * self.delay, self.poll_max)
        return self.delay


def _tighten_timer_slack() -> None:
    """Ask Linux to wake this thread within 1 us of its timeouts (the default slack is 50 us);
    elsewhere, or where prctl is unavailable, keep the default."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0)
