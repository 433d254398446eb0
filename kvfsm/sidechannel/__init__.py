"""The handshake side channel over ZMQ: how an engine rank learns a peer's NIXL agent metadata
and KV block geometry before any transfer.

A `HandshakeListener` (one per engine rank process, ROUTER socket, one daemon thread) serves the
`HandshakePayload` of its agents; `fetch_peer` asks for one (REQ socket, bounded by a timeout)
and `validate` checks its geometry; `ZmqDirectory` runs those off the engine's thread and
implements the runtime's `Directory` protocol. Both ends agree on a `compat_hash`.
"""

from kvfsm.sidechannel._client import fetch_peer, validate
from kvfsm.sidechannel._directory import ZmqDirectory
from kvfsm.sidechannel._listener import HandshakeListener
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

__all__ = [
    "MAX_HANDSHAKE_BYTES",
    "HandshakeAccepted",
    "HandshakeListener",
    "HandshakePayload",
    "HandshakeRefused",
    "HandshakeReply",
    "HandshakeRequest",
    "SidechannelError",
    "Unauthenticated",
    "ZmqDirectory",
    "compat_hash",
    "decode_reply",
    "decode_request",
    "encode",
    "fetch_peer",
    "payload_of",
    "validate",
]
