"""Operator requests on an engine's side-channel listener: drain the engine, or ask its state.

An orchestrator asks "is it safe to stop this engine?" where the engine already listens (its
handshake port, `kvfsm drain HOST:PORT`), not through a process signal that reaches one process
of several. Frames have their own magic, so a handshake decoder never mistakes one; with the
deployment's shared secret they are tagged (HMAC-SHA256, domain ``kvfsm/control``) and the
listener answers only tagged ones: a stranger can neither drain an engine nor fake its answer.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec
import zmq

from kvfsm.sidechannel._frames import Framing
from kvfsm.sidechannel._payload import MAX_HANDSHAKE_BYTES, SidechannelError
from kvfsm.wire import SharedSecret

__all__ = [
    "ControlReply",
    "ControlRequest",
    "decode_control_reply",
    "decode_control_request",
    "encode_control",
    "is_control",
    "request_control",
]

_FRAMES = Framing(b"kvct1", b"kvcm1", b"kvfsm/control", "control", 4096)


class ControlRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Operator -> listener: `drain` the engine (idempotent) or ask its `status`."""

    op: Literal["drain", "status"]
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class ControlReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Listener -> operator: the engine's state (serving, draining, drained), or `refused`
    with `detail` saying why."""

    state: Annotated[str, msgspec.Meta(max_length=32)]
    detail: Annotated[str, msgspec.Meta(max_length=512)] = ""


_Frame = ControlRequest | ControlReply
_encoder = msgspec.msgpack.Encoder()


def is_control(data: bytes) -> bool:
    """Whether `data` is a control frame (else a handshake's, or nobody's)."""
    return _FRAMES.owns(data)


def encode_control(message: _Frame, secret: SharedSecret | None, nonce: bytes = b"") -> bytes:
    """One frame; with `secret`, tagged (a reply's tag covers its request's `nonce`)."""
    kind = b"request" if isinstance(message, ControlRequest) else b"reply"
    return _FRAMES.seal(_encoder.encode(message), kind, nonce, secret)


def decode_control_request(data: bytes, secret: SharedSecret | None) -> ControlRequest:
    """A request frame; `SidechannelError` (`Unauthenticated`) says why one is refused."""
    body = _FRAMES.open(data, b"request", b"", secret)
    try:
        return msgspec.msgpack.decode(body, type=ControlRequest)
    except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
        raise SidechannelError(f"malformed control request: {exc}") from exc


def decode_control_reply(data: bytes, secret: SharedSecret | None, nonce: bytes) -> ControlReply:
    """A reply frame, tagged for the request of `nonce` when there is a secret."""
    body = _FRAMES.open(data, b"reply", nonce, secret)
    try:
        return msgspec.msgpack.decode(body, type=ControlReply)
    except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
        raise SidechannelError(f"malformed control reply: {exc}") from exc


def request_control(
    host: str,
    port: int,
    op: Literal["drain", "status"],
    *,
    secret: SharedSecret | None = None,
    timeout_s: float = 5.0,
) -> ControlReply:
    """Send `op` to the listener at `host:port`; its reply (`SidechannelError` if none came
    within `timeout_s`, or it cannot be read or authenticated)."""
    nonce = b"" if secret is None else os.urandom(16)
    frame = encode_control(ControlRequest(op, nonce), secret)
    timeout_ms = max(1, round(timeout_s * 1000))
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_HANDSHAKE_BYTES)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        sock.send(frame, zmq.NOBLOCK)
        if not sock.poll(timeout_ms, zmq.POLLIN):
            raise SidechannelError(f"no answer from {host}:{port} within {timeout_s:g}s")
        return decode_control_reply(sock.recv(zmq.NOBLOCK), secret, nonce)
    except zmq.ZMQError as exc:
        raise SidechannelError(f"control request to {host}:{port} failed: {exc}") from exc
    finally:
        sock.close(linger=0)
