"""The serving end of the handshake: a ZMQ ROUTER socket answering on one daemon thread."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from types import TracebackType

import zmq

from kvfsm.runtime import Guests
from kvfsm.sidechannel._control import (
    ControlReply,
    ControlRequest,
    decode_control_request,
    encode_control,
    is_control,
)
from kvfsm.sidechannel._payload import (
    _HARD_LIMIT_BYTES,
    MAX_HANDSHAKE_BYTES,
    HandshakeAccepted,
    HandshakePayload,
    HandshakeRefused,
    HandshakeReply,
    SidechannelError,
    Unauthenticated,
    decode_request,
    encode,
)
from kvfsm.sidechannel._status import StatusAnswerer, is_status_frame, status_reply
from kvfsm.wire import SharedSecret

__all__ = ["HandshakeListener"]

_POLL_MS = 50
"""How long the thread waits for a request before checking whether `close()` was called."""
_BATCH = 64
"""Requests answered per wake-up at most, so a flood cannot delay `close()` indefinitely."""


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class HandshakeListener:
    """Answers handshake requests for the agents `payloads` knows (None for an unknown agent).

    `payloads` is called on the listener's thread, not the caller's: it must be thread-safe and
    must not touch the fabric (build each payload in advance and look it up). Binds `host:port`
    (127.0.0.1 by default; port 0 picks a free port, see `.port`); every answer carries the
    times, on `clock` (the engines' clock), the request arrived and the answer left.
    With `secret`, only requests tagged with it are answered, and acceptances are tagged. Each
    accepted requester is admitted to `guests` (shared with the engines the listener serves,
    which take notifications only from peers they handshaked with and from guests).
    `status` answers peers' questions about transfers (on the listener's thread: it must be
    thread-safe and bounded, e.g. a call onto the engine's loop with a timeout); None: they go
    unanswered. `on_control`, if given, answers operator requests (`kvfsm.sidechannel._control`:
    drain, status) with the engine's state; called on the listener's thread, so it must be quick
    and thread-safe. Without it they are refused. `.counters` counts requests by outcome
    (`accepted`, `refused`, `unauthenticated`, `malformed`, `oversized`, `errors`,
    `status_answered`, `status_refused`; disjoint; operator requests as `control`).
    """

    def __init__(
        self,
        payloads: Callable[[str], HandshakePayload | None],
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        secret: SharedSecret | None = None,
        guests: Guests | None = None,
        status: StatusAnswerer | None = None,
        on_control: Callable[[ControlRequest], str] | None = None,
    ) -> None:
        self._payloads = payloads
        self.status = status
        self.on_control = on_control
        self._secret = secret
        self.guests = Guests() if guests is None else guests
        self._clock = clock  # the engines' clock: every answer carries it
        self.host = host
        self.counters: Counter[str] = Counter()
        # An own context: terminating it on close waits until libzmq has really closed the
        # listening socket, so the port can be bound again as soon as close() returns.
        self._context = zmq.Context(io_threads=1)
        self._socket = self._bind(host, port)
        self.port = self._bound_port()
        self._stop = threading.Event()
        self._closed = False
        self.thread = threading.Thread(
            target=self._serve, name=f"kvfsm-handshake-{host}:{self.port}", daemon=True
        )
        self.thread.start()

    def _bind(self, host: str, port: int) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _HARD_LIMIT_BYTES)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(_endpoint(host, "*" if port == 0 else port))
        except zmq.ZMQError as exc:
            sock.close()
            self._context.term()
            if exc.errno == zmq.EADDRINUSE:
                raise SidechannelError(
                    f"cannot listen for handshakes: {host}:{port} is in use (another listener or "
                    f"process holds it); choose another port, or pass port=0 to pick a free one"
                ) from exc
            raise SidechannelError(f"cannot listen for handshakes on {host}:{port}: {exc}") from exc
        return sock

    def _bound_port(self) -> int:
        endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return int(endpoint.rsplit(":", 1)[1])

    # --- serving (listener thread only) --------------------------------------------------------

    def _serve(self) -> None:
        sock = self._socket
        while not self._stop.is_set():
            try:
                if not sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                for _ in range(_BATCH):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(frames)
            except Exception:
                # Whatever went wrong, the next peer must still get answers: count and go on,
                # pausing so that a persistently failing socket cannot spin this thread.
                self.counters["errors"] += 1
                self._stop.wait(_POLL_MS / 1000)

    def _answer(self, frames: list[bytes]) -> None:
        # ROUTER prepends the peer identity; a REQ peer adds an empty delimiter, a DEALER none.
        envelope, body = frames[:1], frames[1:]
        if body and body[0] == b"":
            envelope, body = frames[:2], frames[2:]
        if len(body) == 1 and is_status_frame(body[0]):
            reply_frame, outcome = status_reply(body[0], self.status, self._secret)
            self.counters[f"status_{outcome}"] += 1
            self._socket.send_multipart([*envelope, reply_frame], zmq.NOBLOCK)
            return
        if len(body) == 1 and is_control(body[0]):
            self._socket.send_multipart([*envelope, self._control(body[0])], zmq.NOBLOCK)
            return
        arrived = self._clock()
        nonce = b""
        try:
            reply, outcome, nonce = self._reply(body, arrived)
        except Exception as exc:
            # A failing `payloads` must not leave the asker waiting for its whole timeout.
            reply, outcome = HandshakeRefused(f"listener error: {exc!r:.200}"), "errors"
        self.counters[outcome] += 1
        # Every reply is tagged for the request it answers (a refusal too, so that nobody else
        # can pass one off as ours); an asker without the secret still reads why it was refused.
        # ROUTER drops (never blocks on) replies to peers that went away or are not reading.
        self._socket.send_multipart([*envelope, encode(reply, self._secret, nonce)], zmq.NOBLOCK)

    def _control(self, frame: bytes) -> bytes:
        """An operator's request, answered (refused without `on_control` or the secret)."""
        try:
            request = decode_control_request(frame, self._secret)
        except SidechannelError as exc:
            self.counters[
                "unauthenticated" if isinstance(exc, Unauthenticated) else "malformed"
            ] += 1
            return encode_control(ControlReply("refused", str(exc)[:500]), None)
        self.counters["control"] += 1
        if self.on_control is None:
            reply = ControlReply("refused", "this listener takes no operator requests")
        else:
            try:
                reply = ControlReply(self.on_control(request))
            except Exception as exc:
                reply = ControlReply("refused", f"error: {exc!r:.200}")
        return encode_control(reply, self._secret, request.nonce)

    def _reply(self, body: list[bytes], arrived: float) -> tuple[HandshakeReply, str, bytes]:
        """The reply, the outcome counted, and the nonce its tag covers (none for a request that
        could not be authenticated: its asker could not check a tag anyway)."""
        size = sum(len(frame) for frame in body)
        if size > MAX_HANDSHAKE_BYTES:
            reason = f"oversized request: {size} bytes exceeds {MAX_HANDSHAKE_BYTES}"
            return HandshakeRefused(reason), "oversized", b""
        if len(body) != 1:
            return (
                HandshakeRefused(f"malformed request: {len(body)} frames, not 1"),
                "malformed",
                b"",
            )
        try:
            request = decode_request(body[0], self._secret)
        except Unauthenticated as exc:
            return HandshakeRefused(f"authentication failed: {exc}"), "unauthenticated", b""
        except SidechannelError as exc:
            return HandshakeRefused(str(exc)), "malformed", b""
        payload = self._payloads(request.agent)
        nonce = request.nonce
        if payload is None:
            reason = f"no agent {request.agent!r} at {self.where}"
            return HandshakeRefused(reason), "refused", nonce
        if request.wire_version != payload.wire_version:
            reason = (
                f"wire version mismatch: you speak {request.wire_version}, "
                f"{request.agent!r} speaks {payload.wire_version}"
            )
            return HandshakeRefused(reason), "refused", nonce
        if request.compat_hash != payload.compat_hash:
            g = payload.geometry
            reason = (
                f"compat hash mismatch: you have {request.compat_hash}, "
                f"{request.agent!r} has {payload.compat_hash} (model, dtype, attention geometry, "
                f"mode or wire version differ; {request.agent!r} runs {payload.mode}, "
                f"{g.num_layers} layers, {g.num_kv_heads} KV heads of {g.head_dim}, "
                f"{g.dtype_bytes}-byte values, {'MLA, ' if g.mla else ''}"
                f"{g.kv_layout} pages)"
            )
            return HandshakeRefused(reason), "refused", nonce
        if request.requester:
            self.guests.admit(request.agent, request.requester)
        return HandshakeAccepted(payload, arrived, self._clock()), "accepted", nonce

    # --- lifetime ------------------------------------------------------------------------------

    @property
    def where(self) -> str:
        """`host:port` this listener is bound to."""
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop the thread, close the socket and release the port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.thread.join()
        # The thread has ended: closing its socket here is safe (join is a memory barrier).
        self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> HandshakeListener:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"HandshakeListener({self.where}, {state}, {dict(self.counters)})"
