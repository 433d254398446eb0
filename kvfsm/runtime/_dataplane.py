"""Where an engine's fabric calls run: its data plane.

* `InlinePlane` ("loop", the default): on the thread that drives the engine, inside its `submit`
  and `poll`; results come back at once, in the order the calls were made. The simulated fabric
  and the checker use it: it keeps their runs deterministic.
* `ThreadedPlane` ("thread"): a thread of its own owns every fabric call: posts, state checks,
  notifications sent and drained, prepared lists. The engine's thread (core, side channel,
  checksums) hands it calls through a deque and a bell (one lock) and takes the results back
  from another deque; no lock is held across a fabric call. NIXL's binding releases the GIL in
  its post, status and notification calls, so the engine's Python runs beside UCX's copies
  instead of in series with them.

Both run one call at a time on one thread (NIXL is not thread-safe) and report what happened as
the same results: `TransferEnded`, `NotifySent`, `NotificationsDrained`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Literal, NamedTuple, Protocol, TypeVar

from kvfsm.core import short_trace
from kvfsm.fabric import (
    Fabric,
    FabricError,
    RemoteDisconnectedError,
    XferHandle,
    XferTelemetry,
)
from kvfsm.runtime._pacing import Backoff, tighten_timer_slack

__all__ = [
    "DATA_PLANES",
    "DataPlane",
    "DataPlaneKind",
    "InlinePlane",
    "NotificationsDrained",
    "NotifySent",
    "PlaneFault",
    "PlaneResult",
    "ThreadedPlane",
    "TransferEnded",
]

T = TypeVar("T")
DataPlaneKind = Literal["loop", "thread"]
"""Where the fabric calls run: on the engine loop's thread, or on a data-plane thread."""
DATA_PLANES: tuple[DataPlaneKind, ...] = ("loop", "thread")
_CALL_TIMEOUT_S = 30.0
import os as _os  # EXPERIMENT

_YIELD = bool(_os.environ.get("KVFSM_PLANE_YIELD"))


class TransferEnded(NamedTuple):
    """A transfer the plane was asked to post ended (or could not be posted)."""

    transfer_id: int
    ok: bool
    why: str
    posted: bool
    """False: creating or posting it failed."""
    lost: bool
    """The fabric said the peer disconnected."""
    telemetry: XferTelemetry | None
    faults: tuple[str, ...]
    """Cleanup calls that failed ("telemetry", "release"): counted, not fatal."""


class NotifySent(NamedTuple):
    """A notification was sent, or failed."""

    peer: str
    ok: bool
    lost: bool
    request_id: str
    transfer_id: int | None
    """Set where the notification is a transfer's whole completion (no bytes to move)."""


class PlaneFault(NamedTuple):
    """A bug the data-plane thread contained (an exception that is not a fabric error): the
    thread goes on; a transfer it was posting ends failed."""

    detail: str
    trace: str


class NotificationsDrained(NamedTuple):
    """Notifications the fabric received, by sender (`failed`: draining raised)."""

    by_sender: dict[str, list[bytes]]
    failed: bool


PlaneResult = TransferEnded | NotifySent | NotificationsDrained | PlaneFault
MakeTransfer = Callable[[Fabric], XferHandle]


class DataPlane(Protocol):
    """What the engine asks of its data plane."""

    fabric: Fabric
    threaded: bool
    busy: bool
    """Set by the engine: requests are live (the plane keeps draining notifications often)."""

    def start(self, on_results: Callable[[], None], pacing: Backoff, idle_poll_s: float) -> None:
        """Begin (a thread's plane starts it, polling as `pacing` and `idle_poll_s` say: see
        `ThreadedPlane`); `on_results` is called when results wait."""
        ...

    def post(self, transfer_id: int, make: MakeTransfer) -> XferHandle | None:
        """Create (`make`) and post a transfer; its `TransferEnded` follows. Returns the handle
        where it is known on the caller's thread."""
        ...

    def send(self, peer: str, payload: bytes, request_id: str, transfer_id: int | None) -> None:
        """Send a notification; its `NotifySent` follows."""
        ...

    def cancel(self, transfer_id: int) -> None:
        """Release a transfer still in flight; returns once it is released (no byte lands after
        it), and no result follows for it."""
        ...

    def run(self, fn: Callable[[Fabric], T]) -> T:
        """Run `fn(fabric)` where the fabric calls run and return its result (set-up and tear-down:
        routes, peers)."""
        ...

    def progress(self) -> bool:
        """Deliver the results that wait (inline: drain notifications and check transfers
        first); True if any."""
        ...

    def close(self) -> None:
        """Stop, then release every transfer still in flight."""
        ...


class InlinePlane:
    """Fabric calls on the caller's thread; results delivered at once."""

    threaded = False

    def __init__(self, fabric: Fabric, deliver: Callable[[PlaneResult], None]) -> None:
        self.fabric = fabric
        self.busy = False
        self._deliver = deliver
        self._handles: dict[int, XferHandle] = {}

    def start(self, on_results: Callable[[], None], pacing: Backoff, idle_poll_s: float) -> None:
        """Nothing to start: the caller's thread runs every call."""

    def post(self, transfer_id: int, make: MakeTransfer) -> XferHandle | None:
        """Post now; a transfer that ended inside the post reports at once."""
        handle, ended = _post(self.fabric, transfer_id, make)
        if ended is None and handle is not None:
            self._handles[transfer_id] = handle
        else:
            self._deliver(ended)  # type: ignore[arg-type]  # one of the two is set
        return handle

    def send(self, peer: str, payload: bytes, request_id: str, transfer_id: int | None) -> None:
        """Send now."""
        self._deliver(_send(self.fabric, peer, payload, request_id, transfer_id))

    def cancel(self, transfer_id: int) -> None:
        """Release now."""
        handle = self._handles.pop(transfer_id, None)
        if handle is not None:
            _release(self.fabric, handle)

    def run(self, fn: Callable[[Fabric], T]) -> T:
        """Run now."""
        return fn(self.fabric)

    def progress(self) -> bool:
        """Drain notifications, then check every transfer in flight."""
        drained = _drain(self.fabric)
        if drained is not None:
            self._deliver(drained)
        active = drained is not None
        for tid, handle in list(self._handles.items()):
            ended = _check(self.fabric, tid, handle)
            if ended is not None:
                del self._handles[tid]
                self._deliver(ended)
                active = True
        return active

    def close(self) -> None:
        """Release what is still in flight."""
        for handle in self._handles.values():
            _release(self.fabric, handle)
        self._handles.clear()


class ThreadedPlane:
    """A data-plane thread that owns the fabric; see the module docstring.

    It polls like the engine loop does when inline (`Backoff`): every `poll_min_s` while its
    transfers are in flight or for `hot_s` after the last activity, backing off to `poll_max_s`
    while requests are live, and every `idle_poll_s` when none is. Between polls it waits on its
    event, so a call from the engine's thread starts at once and the GIL is free meanwhile.
    """

    threaded = True

    def __init__(self, fabric: Fabric, deliver: Callable[[PlaneResult], None], name: str) -> None:
        self.fabric = fabric
        self._busy = False
        self.pacing = Backoff(20e-6, 1e-3, 1e-3)
        self.idle_poll_s = 0.05
        self.turns = 0
        """Turns of the plane's thread (each: calls, a drain, the checks)."""
        self._deliver = deliver
        self._calls: deque[Callable[[], None]] = deque()
        self._results: deque[PlaneResult] = deque()
        self._bell = _Bell()
        self._handles: dict[int, XferHandle] = {}  # the plane's thread only
        self._on_results: Callable[[], None] = _nothing
        self._fresh = False  # the plane's thread only: results reported this turn
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- from the engine's thread ----------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Requests are live: poll with the pacing, not the idle interval."""
        return self._busy

    @busy.setter
    def busy(self, busy: bool) -> None:
        if busy and not self._busy:  # cut an idle wait short: a request's messages may come
            self._bell.ring()
        self._busy = busy

    def start(self, on_results: Callable[[], None], pacing: Backoff, idle_poll_s: float) -> None:
        """Start the plane's thread; `on_results` (e.g. the engine loop's `wake`) is called
        from it whenever results wait."""
        self._on_results, self.pacing, self.idle_poll_s = on_results, pacing, idle_poll_s
        self._thread.start()

    def post(self, transfer_id: int, make: MakeTransfer) -> XferHandle | None:
        """Queue the post; the handle stays on the plane's thread."""
        self._hand(lambda: self._post(transfer_id, make))
        return None

    def send(self, peer: str, payload: bytes, request_id: str, transfer_id: int | None) -> None:
        """Queue the notification."""
        self._hand(lambda: self._report(_send(self.fabric, peer, payload, request_id, transfer_id)))

    def cancel(self, transfer_id: int) -> None:
        """Release on the plane's thread and wait for it (a result already queued for the
        transfer is the caller's to ignore)."""
        self.run(lambda fabric: self._cancel(fabric, transfer_id))

    def run(self, fn: Callable[[Fabric], T]) -> T:
        """Run on the plane's thread and wait; before it starts and after it stops, here."""
        if not self._thread.is_alive():
            return fn(self.fabric)
        future: Future[T] = Future()

        def call() -> None:
            try:
                future.set_result(fn(self.fabric))
            except BaseException as exc:
                future.set_exception(exc)

        self._hand(call)
        return future.result(_CALL_TIMEOUT_S)

    def progress(self) -> bool:
        """Deliver what the plane's thread has reported."""
        results = self._results
        active = bool(results)
        while results:
            self._deliver(results.popleft())
        return active

    def close(self) -> None:
        """Stop the thread (after the calls already handed to it), then release what is still
        in flight."""
        self._stopping = True
        self._bell.ring()
        if self._thread.is_alive():
            self._thread.join(_CALL_TIMEOUT_S)
        for handle in self._handles.values():
            _release(self.fabric, handle)
        self._handles.clear()

    def _hand(self, call: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"the data plane {self._thread.name} is not running")
        self._calls.append(call)
        self._bell.ring()
        if _YIELD:  # EXPERIMENT
            time.sleep(0)

    # --- the plane's thread ------------------------------------------------------------------------

    def _run(self) -> None:
        tighten_timer_slack()
        bell, calls = self._bell, self._calls
        while True:
            self.turns += 1
            ran = bool(calls)
            while calls:
                self._contained(calls.popleft())
            if self._stopping:
                self._wake()
                return
            self._contained(self._drain)
            self._contained(self._check_all)
            reported = self._wake()
            moving = bool(self._handles)
            delay = self.pacing.next(ran or moving or reported, time.monotonic())
            if not calls:
                bell.wait(delay if moving or self._busy else self.idle_poll_s)

    def _contained(self, call: Callable[[], None]) -> None:
        """Run `call`; a bug in it is reported, and the thread serves on."""
        try:
            call()
        except Exception as exc:
            self._report(PlaneFault(f"data plane: {exc!r}", short_trace(exc)))

    def _report(self, result: PlaneResult) -> None:
        self._results.append(result)
        self._fresh = True

    def _wake(self) -> bool:
        """Tell the engine's thread if results wait; True if so."""
        fresh, self._fresh = self._fresh, False
        if fresh:
            self._on_results()
        return fresh

    def _post(self, transfer_id: int, make: MakeTransfer) -> None:
        try:
            handle, ended = _post(self.fabric, transfer_id, make)
        except Exception as exc:  # a bug: the transfer fails, its request ends
            self._report(TransferEnded(transfer_id, False, repr(exc), False, False, None, ()))
            raise
        if ended is None and handle is not None:
            self._handles[transfer_id] = handle
        else:
            self._report(ended)  # type: ignore[arg-type]  # one of the two is set

    def _cancel(self, fabric: Fabric, transfer_id: int) -> None:
        handle = self._handles.pop(transfer_id, None)
        if handle is not None:
            _release(fabric, handle)

    def _drain(self) -> None:
        drained = _drain(self.fabric)
        if drained is not None:
            self._report(drained)

    def _check_all(self) -> None:
        for tid, handle in list(self._handles.items()):
            ended = _check(self.fabric, tid, handle)
            if ended is not None:
                del self._handles[tid]
                self._report(ended)


class _Bell:
    """An event that resets itself when waited for, on one lock: rung from any thread, waited
    for by one. Cheaper than `threading.Event`, whose every wait builds a lock of its own."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def ring(self) -> None:
        with contextlib.suppress(RuntimeError):  # rung already, not yet waited for
            self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Until rung (True) or `timeout` seconds (False)."""
        return self._lock.acquire(timeout=timeout)


# --- the calls, the same on either plane -------------------------------------------------------


def _post(
    fabric: Fabric, tid: int, make: MakeTransfer
) -> tuple[XferHandle | None, TransferEnded | None]:
    """Create and post: (the handle, None) while it moves, else what ended it."""
    handle = None
    try:
        handle = make(fabric)
        state = fabric.transfer(handle)
    except FabricError as exc:
        faults = () if handle is None else _release(fabric, handle)
        lost = isinstance(exc, RemoteDisconnectedError)
        return handle, TransferEnded(tid, False, str(exc), False, lost, None, faults)
    if state == "PROC":
        return handle, None
    return handle, _ended(fabric, tid, handle, state == "DONE", state, lost=False)


def _check(fabric: Fabric, tid: int, handle: XferHandle) -> TransferEnded | None:
    try:
        state = fabric.check_xfer_state(handle)
    except FabricError as exc:
        return _ended(
            fabric, tid, handle, False, str(exc), isinstance(exc, RemoteDisconnectedError)
        )
    if state == "PROC":
        return None
    return _ended(fabric, tid, handle, state == "DONE", state, lost=False)


def _ended(
    fabric: Fabric, tid: int, handle: XferHandle, ok: bool, why: str, lost: bool
) -> TransferEnded:
    """Take the telemetry of a finished transfer, then release it."""
    telemetry: XferTelemetry | None = None
    faults: tuple[str, ...] = ()
    if ok:
        try:
            telemetry = fabric.xfer_telemetry(handle)
        except FabricError:
            faults = ("telemetry",)
    faults += _release(fabric, handle)
    return TransferEnded(tid, ok, "" if ok else why, True, lost, telemetry, faults)


def _release(fabric: Fabric, handle: XferHandle) -> tuple[str, ...]:
    try:
        fabric.release_xfer_handle(handle)
    except FabricError:
        return ("release",)
    return ()


def _send(
    fabric: Fabric, peer: str, payload: bytes, request_id: str, tid: int | None
) -> NotifySent:
    try:
        fabric.send_notif(peer, payload)
    except FabricError as exc:
        return NotifySent(peer, False, isinstance(exc, RemoteDisconnectedError), request_id, tid)
    return NotifySent(peer, True, False, request_id, tid)


def _drain(fabric: Fabric) -> NotificationsDrained | None:
    try:
        notifs = fabric.get_new_notifs()
    except FabricError:
        return NotificationsDrained({}, True)
    return NotificationsDrained(notifs, False) if notifs else None


def _nothing() -> None:
    return None
