"""The runtime's `Directory` over the ZMQ side channel: handshakes on a small thread pool."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from kvfsm.core import TransferStatus
from kvfsm.runtime import HandshakeError, PeerInfo, StatusQuery
from kvfsm.sidechannel._client import fetch_peer, validate
from kvfsm.sidechannel._payload import HandshakePayload
from kvfsm.sidechannel._status import ask_status
from kvfsm.wire import SharedSecret

__all__ = ["ZmqDirectory"]

_Result = PeerInfo | HandshakeError


class ZmqDirectory:
    """Implements the runtime's `Directory`: `start(peer)` fetches the peer agent's payload from
    the listener at `addresses[peer]` (a mapping, or a callable that may raise for unknown peers)
    off the caller's thread; `results()` hands back finished handshakes and never raises.

    Every payload goes through `check` (default: `validate` with no expectations, i.e. a
    consistent payload); pass e.g. ``functools.partial(validate, expect_mode="pull",
    local=geometry)`` for more. `wait(timeout)` blocks until a result is ready, for loops with
    nothing else to do; `on_result` (if set) is called from the handshake thread whenever one
    is, e.g. to wake an engine loop. Each handshake measures the peer's clock against `clock`
    (the engines' clock, `time.monotonic`): deadlines between hosts are converted with it.
    With `secret`, requests are tagged and only acceptances tagged for them are taken;
    `requester` is the agent the handshakes are for (the peer then takes its notifications).
    `ask(peer, query)` asks a peer it handshaked with about a transfer (at the address its
    payload names, else where its handshake was answered), as bounded as a handshake; the
    answers come from `answers()`. A question waits `ask_timeout_s` at most (it is answered
    from memory; a peer that cannot answer within it is "unanswered", and the question must be
    answered before the bound it runs ahead of).
    """

    def __init__(
        self,
        addresses: Callable[[str], tuple[str, int]] | Mapping[str, tuple[str, int]],
        *,
        compat_hash: str,
        wire_version: int,
        timeout_s: float = 5.0,
        max_workers: int = 4,
        check: Callable[[HandshakePayload], None] = validate,
        clock: Callable[[], float] = time.monotonic,
        secret: SharedSecret | None = None,
        requester: str = "",
        ask_timeout_s: float = 1.0,
    ) -> None:
        if timeout_s <= 0 or max_workers < 1:
            raise ValueError(f"need timeout_s > 0 and max_workers >= 1: {timeout_s}, {max_workers}")
        self._addresses = addresses
        self.compat_hash = compat_hash
        self.wire_version = wire_version
        self.timeout_s = timeout_s
        self.ask_timeout_s = min(ask_timeout_s, timeout_s)
        self._check = check
        self._clock = clock  # the engines' clock, to learn each peer's offset from it
        self._secret = secret
        self.requester = requester
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvfsm-directory")
        self._ready = threading.Condition()
        self._done: list[tuple[str, _Result]] = []  # guarded by _ready
        self._answers: list[tuple[StatusQuery, TransferStatus]] = []  # guarded by _ready
        self._status_at: dict[str, tuple[str, int]] = {}  # guarded by _ready
        self._pending = 0  # guarded by _ready
        self._closed = False  # guarded by _ready
        self.on_result: Callable[[], None] | None = None

    @property
    def pending(self) -> int:
        """Handshakes started and not yet finished."""
        with self._ready:
            return self._pending

    def start(self, peer: str, contact: str = "") -> None:
        """Begin a handshake with agent `peer` at `contact` ("host:port"; else the address
        `addresses` gives); its result appears in `results()`."""
        with self._ready:
            if self._closed:
                self._done.append(
                    (peer, HandshakeError(f"handshake with {peer!r}: directory closed"))
                )
                self._ready.notify_all()
                return
            self._pending += 1
            future = self._pool.submit(self._handshake, peer, contact)
        future.add_done_callback(lambda f: self._finish(peer, f))

    def results(self) -> list[tuple[str, PeerInfo | HandshakeError]]:
        """Handshakes finished since the last call: the peer's information or why it failed."""
        with self._ready:
            done, self._done = self._done, []
        return done

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a result is ready (or `timeout` seconds pass); True if one is."""
        with self._ready:
            return self._ready.wait_for(lambda: bool(self._done or self._answers), timeout)

    def ask(self, peer: str, query: StatusQuery) -> None:
        """Ask `peer` about a transfer off the caller's thread; see `answers()`."""
        with self._ready:
            where = self._status_at.get(peer)
            if where is None or self._closed:
                self._answers.append((query, "unanswered"))  # never handshaked: nowhere to ask
                self._ready.notify_all()
                return
            future = self._pool.submit(
                ask_status, *where, query, timeout_s=self.ask_timeout_s, secret=self._secret
            )
        future.add_done_callback(lambda f: self._answered(query, f))

    def answers(self) -> list[tuple[StatusQuery, TransferStatus]]:
        """Questions answered since the last call ("unanswered": no answer in time)."""
        with self._ready:
            done, self._answers = self._answers, []
        return done

    def _answered(self, query: StatusQuery, future: Future[TransferStatus]) -> None:
        ok = not future.cancelled() and future.exception() is None
        status: TransferStatus = future.result() if ok else "unanswered"
        with self._ready:
            self._answers.append((query, status))
            self._ready.notify_all()
        if self.on_result is not None:
            self.on_result()

    def _resolve(self, peer: str, contact: str) -> tuple[str, int]:
        try:
            if contact:
                host, _, port = contact.rpartition(":")
                return host.strip("[]"), int(port)
            book = self._addresses
            address = book(peer) if callable(book) else book[peer]
            return address[0], int(address[1])
        except Exception as exc:
            raise HandshakeError(f"no side-channel address for {peer!r}: {exc!r}") from exc

    def _handshake(self, peer: str, contact: str) -> _Result:
        # Runs on a pool thread; anything it raises becomes a failed handshake in `_finish`.
        host, port = self._resolve(peer, contact)
        payload, offset, error = fetch_peer(
            host,
            port,
            peer,
            compat_hash=self.compat_hash,
            wire_version=self.wire_version,
            timeout_s=self.timeout_s,
            clock=self._clock,
            secret=self._secret,
            requester=self.requester,
        )
        self._check(payload)
        layout = payload.layout()
        status_at = (host, port)
        if payload.status_contact:
            status_host, _, status_port = payload.status_contact.rpartition(":")
            status_at = (status_host.strip("[]"), int(status_port))
        with self._ready:
            self._status_at[peer] = status_at
        return PeerInfo(
            payload.agent, payload.agent_metadata, layout, offset, error, payload.incarnation
        )

    def _finish(self, peer: str, future: Future[_Result]) -> None:
        result: _Result
        if future.cancelled():
            result = HandshakeError(f"handshake with {peer!r} cancelled: directory closed")
        else:
            exc = future.exception()
            if exc is None:
                result = future.result()
            elif isinstance(exc, HandshakeError):
                result = exc
            else:
                result = HandshakeError(f"handshake with {peer!r} failed: {exc!r}")
                result.__cause__ = exc
        with self._ready:
            self._pending -= 1
            self._done.append((peer, result))
            self._ready.notify_all()
        if self.on_result is not None:
            self.on_result()

    def close(self) -> None:
        """Cancel queued handshakes and wait for running ones (each ends within `timeout_s`)."""
        with self._ready:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ZmqDirectory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
