"""Questions about a transfer over the side channel: "what became of your transfer for my
request?", asked when its completion notification is overdue (NIXL's notifications are
best-effort), answered from the peer's request state.

The frames ride the handshake listener's socket under their own magic, bounded and type-checked
like handshakes; with the deployment's shared secret a question is tagged and only an answer
tagged for its nonce is taken, so nobody else can make a request pass as received. Any failure
(no answer in time, refused, undecodable, unauthenticated) is "unanswered": never a guess.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import msgspec

from kvfsm.core import TransferStatus
from kvfsm.runtime import StatusQuery
from kvfsm.sidechannel._client import _exchange
from kvfsm.sidechannel._frames import Framing
from kvfsm.sidechannel._payload import MAX_HANDSHAKE_BYTES, SidechannelError, new_nonce
from kvfsm.wire import SharedSecret

__all__ = [
    "StatusAnswer",
    "StatusAnswerer",
    "StatusRequest",
    "ask_status",
    "is_status_frame",
    "status_reply",
]

_FRAMES = Framing(b"kvst1", b"kvsm1", b"kvfsm/status", "status", MAX_HANDSHAKE_BYTES)


class StatusRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Asking side -> listener: the question, and the nonce the answer's tag must cover."""

    query: StatusQuery
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class StatusAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Listener -> asking side: what the asked engine says of its transfer."""

    status: TransferStatus


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(StatusRequest)
_answer_decoder = msgspec.msgpack.Decoder(StatusAnswer)


def is_status_frame(data: bytes) -> bool:
    """Whether a frame reaching the listener is a status question (else a handshake's)."""
    return _FRAMES.owns(data)


StatusAnswerer = Callable[[StatusQuery], TransferStatus]
"""How an engine answers a peer's question about a transfer (`Engine.transfer_status`)."""


def status_reply(
    data: bytes, answer: StatusAnswerer | None, secret: SharedSecret | None = None
) -> tuple[bytes, str]:
    """The listener's reply frame to a status question, and the outcome to count. `answer` is
    called with the decoded `StatusQuery` and returns a `TransferStatus`; a question that
    cannot be decoded or authenticated gets "unanswered", untagged."""
    try:
        body = _FRAMES.open(data, b"question", b"", secret)
        request = _request_decoder.decode(body)
    except (SidechannelError, msgspec.MsgspecError, ValueError, RecursionError):
        return _FRAMES.seal(
            _encoder.encode(StatusAnswer("unanswered")), b"answer", b"", None
        ), "refused"
    status: TransferStatus = "unanswered" if answer is None else answer(request.query)
    reply = _encoder.encode(StatusAnswer(status))
    return _FRAMES.seal(reply, b"answer", request.nonce, secret), "answered"


def ask_status(
    host: str,
    port: int,
    query: StatusQuery,
    *,
    timeout_s: float,
    secret: SharedSecret | None = None,
) -> TransferStatus:
    """Ask the listener at `host:port` about `query`'s transfer, within `timeout_s`; any
    failure is "unanswered"."""
    nonce = b"" if secret is None else new_nonce()
    body = _encoder.encode(StatusRequest(query, nonce))
    try:
        data = _exchange(host, port, _FRAMES.seal(body, b"question", b"", secret), timeout_s)
        answer = _answer_decoder.decode(_FRAMES.open(data, b"answer", nonce, secret))
    except Exception:  # HandshakeError, SidechannelError, msgspec's: no answer, no guess
        return "unanswered"
    return answer.status
