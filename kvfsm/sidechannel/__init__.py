"""The handshake side channel over ZMQ: how an engine rank learns a peer's NIXL agent metadata
and KV block geometry before any transfer.

A `HandshakeListener` (one per engine rank process, ROUTER socket, one daemon thread) serves the
`HandshakePayload` of its agents; `fetch_peer` asks for one (REQ socket, bounded by a timeout)
and `validate` checks its geometry; `ZmqDirectory` runs those off the engine's thread and
implements the runtime's `Directory` protocol. `LocalDirectory` implements the same protocol
within one process, for the simulated fabric. Both ends agree on a `compat_hash`.
"""

from kvfsm.sidechannel._client import fetch_peer, validate
from kvfsm.sidechannel._clock import clock_offset
from kvfsm.sidechannel._control import ControlReply, ControlRequest, request_control
from kvfsm.sidechannel._listener import HandshakeListener
from kvfsm.sidechannel._local_directory import DirectorySnapshot, DirectoryView, LocalDirectory
from kvfsm.sidechannel._payload import (
    MAX_HANDSHAKE_BYTES,
    HandshakeAccepted,
    HandshakePayload,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    SidechannelError,
    Unauthenticated,
    compat_hash,
    decode_reply,
    decode_request,
    encode,
    payload_of,
)
from kvfsm.sidechannel._status import StatusAnswer, StatusAnswerer, StatusRequest, ask_status
from kvfsm.sidechannel._zmq_directory import ZmqDirectory

__all__ = [
    "MAX_HANDSHAKE_BYTES",
    "ControlReply",
    "ControlRequest",
    "DirectorySnapshot",
    "DirectoryView",
    "HandshakeAccepted",
    "HandshakeListener",
    "HandshakePayload",
    "HandshakeRefused",
    "HandshakeReply",
    "HandshakeRequest",
    "LocalDirectory",
    "SidechannelError",
    "StatusAnswer",
    "StatusAnswerer",
    "StatusRequest",
    "Unauthenticated",
    "ZmqDirectory",
    "ask_status",
    "clock_offset",
    "compat_hash",
    "decode_reply",
    "decode_request",
    "encode",
    "fetch_peer",
    "payload_of",
    "request_control",
    "validate",
]
