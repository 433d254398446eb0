"""Messages between engines, carried as NIXL notifications, and their codec.

Every message is a tagged msgspec Struct; decoding validates the type of every field and the payload
size is bounded, so a malformed notification becomes a counted `WireError`, never a crash. Block ids
travel as packed little-endian int32: bytes decode far faster than a msgpack list of integers.
"""

from __future__ import annotations

import re

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = [
    "MAX_MESSAGE_BYTES",
    "WIRE_VERSION",
    "BlockIds",
    "Cancel",
    "CancelAck",
    "Completion",
    "Failure",
    "Goodbye",
    "Grant",
    "Heartbeat",
    "Message",
    "Progress",
    "Registration",
    "WireError",
    "base_request_id",
    "decode",
    "encode",
    "pack_blocks",
    "unpack_blocks",
]

MAX_MESSAGE_BYTES = 1 << 20
"""Largest notification accepted (a registration of ~260,000 blocks)."""

WIRE_VERSION = 3
"""The version of these messages (2: registrations and grants name the sender's incarnation;
3: completions and grants may carry a checksum of the bytes; engines say goodbye). It enters
every handshake's compatibility hash and payload, so engines speaking different versions
refuse each other before any transfer."""

BlockIds = npt.NDArray[np.int32]

_SUFFIX = re.compile(r"-[0-9a-fA-F]{8}\Z")
_MAGIC = b"kv1"  # kvfsm notification framing; anything else is not ours
_LE_INT32 = np.dtype("<i4")  # built once, not parsed from its string per message


class WireError(ValueError):
    """A notification could not be decoded: too large, not ours, or malformed."""


class _Msg(msgspec.Struct, frozen=True, tag_field="k", forbid_unknown_fields=True):
    """Fields every message has: the receiver's request id as the sender knows it, the sender's
    own id for the request, and the sender's rank and TP size."""

    request_id: str
    sender_request_id: str
    rank: int
    tp_size: int


class Registration(_Msg, frozen=True, tag="reg"):
    """D -> P: D's blocks for a request (push: write here; pull: I am about to read). Push: P
    must not post a WRITE at or after `deadline` (D's clock; P converts it with the offset its
    handshake with D measured), so D can bound its fence.
    `contact` is where D's side channel listens ("host:port", "" if P knows already): P
    handshakes back with D there before it writes (push) or grants (pull). `incarnation` is
    the sending process's (0: unknown): its block ids mean nothing to a restarted D."""

    engine_id: str
    block_ids: bytes
    deadline: float
    contact: str = ""
    incarnation: int = 0


class Grant(_Msg, frozen=True, tag="grant"):
    """P -> D (pull): read these P blocks now. D must not post a READ it could not finish (cancel)
    before `deadline` (P's clock, converted by D with its handshake's offset): P may release the
    blocks after it. `incarnation` as in `Registration`. `checksum` (with `verify` on): of the
    bytes D's READ will take, which D checks before it reports them received."""

    block_ids: bytes
    deadline: float
    incarnation: int = 0
    checksum: int | None = None


class Progress(_Msg, frozen=True, tag="writing"):
    """P -> D (push): the registration matched and the WRITE is being posted."""


class Completion(_Msg, frozen=True, tag="done"):
    """Attached to a WRITE (to D) or READ (to P): the sender's transfer completed. A WRITE's
    (with `verify` on) carries the `checksum` of the bytes P wrote and P's block count
    (`sender_blocks`: D pairs its blocks with P's last ones), which D checks before it reports
    the blocks received."""

    checksum: int | None = None
    sender_blocks: int = 0


class Failure(_Msg, frozen=True, tag="fail"):
    """Either way: the request is gone or failed on the sender; stop waiting for it."""

    reason: str


class Cancel(_Msg, frozen=True, tag="cancel"):
    """D -> P: D gave up on the request; push: do not write; pull: nothing is reading.
    `contact` as in `Registration` (a cancel may be the first message P gets from D)."""

    contact: str = ""


class CancelAck(_Msg, frozen=True, tag="ack"):
    """P -> D (push): no WRITE of this request can land any more."""


class Heartbeat(msgspec.Struct, frozen=True, tag_field="k", tag="hb", forbid_unknown_fields=True):
    """D -> P: D still waits for these requests (D's and, when known, P's ids)."""

    request_ids: list[str]
    rank: int


class Goodbye(msgspec.Struct, frozen=True, tag_field="k", tag="bye", forbid_unknown_fields=True):
    """Either way: the sender is drained or closing; unload its agent now (its memory stays
    mapped otherwise until an idle sweep). `incarnation` is the sending process's (0: unknown):
    a late goodbye from a previous process must not drop a connection to its successor."""

    rank: int
    tp_size: int
    incarnation: int = 0


Message = (
    Registration
    | Grant
    | Progress
    | Completion
    | Failure
    | Cancel
    | CancelAck
    | Heartbeat
    | Goodbye
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """Encode a message as a notification payload."""
    return _MAGIC + _encoder.encode(message)


def decode(payload: bytes) -> Message:
    """Decode a notification payload; raise `WireError` saying why it is rejected."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise WireError(f"notification of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    if not payload.startswith(_MAGIC):
        raise WireError(f"not a kvfsm v1 notification (starts {payload[:8]!r})")
    try:
        message: Message = _decoder.decode(payload[len(_MAGIC) :])
    # ValueError: e.g. invalid UTF-8 in a str; RecursionError: deeply nested msgpack.
    except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
        raise WireError(f"malformed notification: {exc}") from exc
    if message.rank < 0 or (not isinstance(message, Heartbeat) and message.tp_size < 1):
        raise WireError(f"notification with impossible rank/tp: {message!r:.200}")
    if isinstance(message, (Registration, Grant)) and len(message.block_ids) % 4:
        raise WireError("block ids are not a whole number of int32")
    return message


def pack_blocks(block_ids: npt.ArrayLike) -> bytes:
    """Block ids as packed little-endian int32; ids outside [0, 2**31) raise ValueError."""
    ids = np.asarray(block_ids)
    if ids.dtype == np.int32:  # what the core passes: validated when the caller handed it over
        return ids.astype("<i4", copy=False).tobytes()
    if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
        raise ValueError(f"block ids must lie in [0, 2**31): got {ids.min()}..{ids.max()}")
    return ids.astype("<i4").tobytes()


def unpack_blocks(data: bytes) -> BlockIds:
    """The inverse of `pack_blocks` (a read-only view, no copy)."""
    return np.frombuffer(data, dtype=_LE_INT32)


def base_request_id(request_id: str) -> str:
    """The request id without a trailing ``-<8 hex>`` suffix (where P's and D's ids differ)."""
    if len(request_id) > 8 and _SUFFIX.search(request_id):
        return request_id[:-9]
    return request_id
