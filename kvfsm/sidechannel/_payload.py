"""What the handshake side channel carries: a request, a reply and the payload it describes.

The side channel runs before any NIXL connection exists: it tells the asking engine rank the
peer's agent metadata and where its KV blocks are. Both ends agree on a `compat_hash` covering what
must be equal on both sides (model, dtype, attention geometry, mode, wire version); what may differ
(TP size, block size, K/V split) travels in the payload and is checked by `validate`. Every frame is bounded
and type-checked on decode, so garbage from the network becomes a `SidechannelError`, never a crash.
With a deployment's shared secret, requests and acceptances are tagged (HMAC-SHA256) and checked.
"""

from __future__ import annotations

import hashlib
import os
from typing import Annotated

import msgspec

from kvfsm.layout import KvGeometry, RegionLayout
from kvfsm.runtime import Engine
from kvfsm.wire import TAG_BYTES, AuthError, SharedSecret

__all__ = [
    "MAX_HANDSHAKE_BYTES",
    "HandshakeAccepted",
    "HandshakePayload",
    "HandshakeRefused",
    "HandshakeReply",
    "HandshakeRequest",
    "SidechannelError",
    "Unauthenticated",
    "compat_hash",
    "decode_reply",
    "decode_request",
    "encode",
    "new_nonce",
    "payload_of",
]

MAX_HANDSHAKE_BYTES = 1 << 20
"""Largest request or reply accepted. NIXL agent metadata is a few KiB; 1 MiB leaves headroom
while bounding what a stray client can make a listener allocate and parse."""

_HARD_LIMIT_BYTES = 2 * MAX_HANDSHAKE_BYTES
"""ZMQ_MAXMSGSIZE of both ends: libzmq drops (without a reply) a connection sending a bigger
frame, so a stray peer cannot make us buffer arbitrary amounts; frames between the two limits
get a refusal or error saying why."""

_MAGIC = b"kvhs1"  # kvfsm handshake framing v1: lets a decoder say "not ours" before parsing
_SEALED = b"kvhm1"  # the same, tagged with the shared secret: magic, tag, body
_NONCE_BYTES = 16


class SidechannelError(Exception):
    """A side-channel frame or socket problem: malformed or oversized frame, port in use."""


class Unauthenticated(SidechannelError):
    """A frame is not tagged with this deployment's shared secret (or not for this exchange)."""


class HandshakeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Asking side -> listener: the agent it wants, its own wire version and compat hash, and
    the agent asking (the listener's engines then take its notifications)."""

    agent: str
    wire_version: int
    compat_hash: str
    requester: Annotated[str, msgspec.Meta(max_length=256)] = ""
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    """Random bytes of an authenticated request: the acceptance's tag covers them, so an old
    acceptance cannot be replayed as the answer to a new request."""


class HandshakePayload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a peer needs to reach one engine rank's KV blocks over NIXL.

    `geometry` carries the rank's KV shape: layers, KV heads, head dim, dtype bytes, block size
    (tokens), number of blocks, TP size and rank, K/V split, MLA and page layout (HND/NHD); it
    is validated as it is decoded. `base_addresses` and `block_lens` have one entry per region.
    `incarnation` names the rank's process (0: unknown): a peer writes or reads blocks only for
    messages from the incarnation its handshake reached.
    """

    engine_id: str
    agent: str
    agent_metadata: bytes
    geometry: KvGeometry
    base_addresses: tuple[int, ...]
    block_lens: tuple[int, ...]
    mode: str
    wire_version: int
    compat_hash: str
    device: int = 0
    incarnation: int = 0
    status_contact: Annotated[str, msgspec.Meta(max_length=256)] = ""
    """Where the rank answers questions about its transfers ("host:port"; "": at the listener
    that served this payload)."""

    @property
    def rank(self) -> int:
        """The rank's place in its engine's TP group."""
        return self.geometry.tp_rank

    @property
    def tp_size(self) -> int:
        """The size of its engine's TP group."""
        return self.geometry.tp_size

    def layout(self) -> RegionLayout:
        """Where the rank's regions are; ValueError if they are inconsistent."""
        return RegionLayout(self.geometry, self.base_addresses, self.device)


_Clock = Annotated[float, msgspec.Meta(ge=-1e15, le=1e15)]  # finite: NaN fails the bounds


class HandshakeAccepted(
    msgspec.Struct, frozen=True, tag_field="k", tag="ok", forbid_unknown_fields=True
):
    """Listener -> asking side: the payload of the requested agent, and the listener's clock
    (the engines' clock, `time.monotonic`) when the request arrived and when it answered: the
    asking side learns the offset between the hosts' clocks from them."""

    payload: HandshakePayload
    received: _Clock
    sent: _Clock


class HandshakeRefused(
    msgspec.Struct, frozen=True, tag_field="k", tag="no", forbid_unknown_fields=True
):
    """Listener -> asking side: the request was refused, and why."""

    reason: str


HandshakeReply = HandshakeAccepted | HandshakeRefused

_Frame = HandshakeRequest | HandshakeAccepted | HandshakeRefused

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)


def encode(message: _Frame, secret: SharedSecret | None = None, nonce: bytes = b"") -> bytes:
    """Encode a request or a reply as one side-channel frame; with `secret`, tagged (a reply's
    tag also covers the `nonce` of the request it answers)."""
    body = _encoder.encode(message)
    if secret is None:
        return _MAGIC + body
    return _SEALED + secret.tag(b"kvfsm/handshake", _kind(message), nonce, body) + body


def new_nonce() -> bytes:
    """Random bytes for an authenticated request."""
    return os.urandom(_NONCE_BYTES)


def _kind(message: _Frame) -> bytes:
    return b"request" if isinstance(message, HandshakeRequest) else b"reply"


def _body(data: bytes, what: str) -> tuple[bytes, bytes | None]:
    """A frame's body and its tag (None if untagged)."""
    if len(data) > MAX_HANDSHAKE_BYTES:
        raise SidechannelError(f"{what} of {len(data)} bytes exceeds {MAX_HANDSHAKE_BYTES}")
    if data.startswith(_SEALED) and len(data) >= len(_SEALED) + TAG_BYTES:
        start = len(_SEALED) + TAG_BYTES
        return data[start:], data[len(_SEALED) : start]
    if not data.startswith(_MAGIC):
        raise SidechannelError(f"{what} is not a kvfsm handshake frame (starts {data[:8]!r})")
    return data[len(_MAGIC) :], None


def _authenticate(
    secret: SharedSecret, tag: bytes | None, kind: bytes, nonce: bytes, body: bytes
) -> None:
    if tag is None:
        raise Unauthenticated(f"untagged {kind.decode()}: this side needs the shared secret")
    try:
        secret.check(tag, b"kvfsm/handshake", kind, nonce, body)
    except AuthError:
        raise Unauthenticated(
            f"{kind.decode()} with a wrong tag: the other side holds another shared secret"
        ) from None


def decode_request(data: bytes, secret: SharedSecret | None = None) -> HandshakeRequest:
    """Decode a request frame; raise `SidechannelError` saying why it is rejected
    (`Unauthenticated` if `secret` is given and the frame is not tagged with it)."""
    body, tag = _body(data, "request")
    if secret is not None:
        _authenticate(secret, tag, b"request", b"", body)
    try:
        request = _request_decoder.decode(body)
    # ValueError: e.g. invalid UTF-8 in a str; RecursionError: deeply nested msgpack.
    except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
        raise SidechannelError(f"malformed request: {exc}") from exc
    if not request.agent:
        raise SidechannelError("malformed request: empty agent name")
    return request


def decode_reply(
    data: bytes, secret: SharedSecret | None = None, nonce: bytes = b""
) -> HandshakeReply:
    """Decode a reply frame; raise `SidechannelError` saying why it is rejected. With `secret`,
    an acceptance or a refusal must be tagged with it for the request of `nonce`
    (`Unauthenticated`, quoting what an unauthenticated refusal claims): whoever else answers
    can neither grant a handshake nor pass a refusal off as the listener's."""
    body, tag = _body(data, "reply")
    try:
        reply: HandshakeReply = _reply_decoder.decode(body)
    except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
        raise SidechannelError(f"malformed reply: {exc}") from exc
    if secret is not None:
        try:
            _authenticate(secret, tag, b"reply", nonce, body)
        except Unauthenticated as exc:
            if isinstance(reply, HandshakeRefused):
                raise Unauthenticated(f"{exc} (it claims: {reply.reason!r:.200})") from None
            raise
    return reply


def compat_hash(
    *, wire_version: int, mode: str, model: str, dtype: str, geometry: KvGeometry
) -> str:
    """The sha256 (hex) of what must be equal on both sides for their KV blocks to be exchangeable:
    the wire version, the mode, the model's identity and dtype, and its layer/head geometry.

    `geometry.num_kv_heads` is the model's total (not per TP rank): TP sizes, block sizes, block
    counts and the K/V split may differ between the sides; they travel in the payload and are
    checked by `validate`.
    """
    g = geometry
    # A fixed-order msgpack array of plain values encodes identically everywhere; the leading
    # label keeps these hashes apart from any other sha256 of similar-looking data.
    fields = [
        "kvfsm-compat/2",
        wire_version,
        mode,
        model,
        dtype,
        g.num_layers,
        g.num_kv_heads,
        g.head_dim,
        g.dtype_bytes,
        g.mla,
        g.kv_layout,
    ]
    return hashlib.sha256(_encoder.encode(fields)).hexdigest()


def payload_of(
    engine: Engine, *, compat_hash: str, wire_version: int, status_contact: str = ""
) -> HandshakePayload:
    """The handshake payload of an engine rank (built on the thread that owns its fabric, once its
    memory is registered: NIXL's metadata is a snapshot)."""
    layout = engine.kv.layout
    g = layout.geometry
    return HandshakePayload(
        engine_id=engine.side.identity.engine_id,
        agent=engine.agent,
        agent_metadata=engine.fabric.get_agent_metadata(),
        geometry=g,
        base_addresses=layout.base_addresses,
        block_lens=(g.block_len,) * g.num_regions,
        mode=engine.side.mode,
        wire_version=wire_version,
        compat_hash=compat_hash,
        device=layout.device,
        incarnation=engine.incarnation,
        status_contact=status_contact,
    )
