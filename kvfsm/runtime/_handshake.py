"""The handshake's contract between an engine and its side channel: what a handshake learns of a
peer (`PeerInfo`), how it fails (`HandshakeError`), and how an engine asks for one (`Directory`,
which kvfsm.sidechannel implements over ZMQ and in process)."""

from __future__ import annotations

from typing import Annotated, Protocol

import msgspec

from kvfsm.core import TransferStatus
from kvfsm.layout import RegionLayout

__all__ = ["Directory", "HandshakeError", "PeerInfo", "StatusQuery"]


class PeerInfo(msgspec.Struct, frozen=True):
    """What a handshake learns about a peer rank: its agent, where its KV regions are, its
    clock (the peer's clock minus ours, within `clock_error` seconds) and which process
    answered (`incarnation`, 0: unknown)."""

    agent: str
    metadata: bytes
    layout: RegionLayout
    clock_offset: float = 0.0
    clock_error: float = 0.0
    incarnation: int = 0


class HandshakeError(Exception):
    """A handshake failed; the message says why."""


class Directory(Protocol):
    """How an engine reaches its peers' handshake information (asynchronously: a real side channel
    runs handshakes off the engine's thread)."""

    def start(self, peer: str, contact: str = "") -> None:
        """Begin a handshake with `peer`, at `contact` ("host:port") if the core learned one."""
        ...

    def results(self) -> list[tuple[str, PeerInfo | HandshakeError]]:
        """Handshakes finished since the last call: the peer's information or why it failed."""
        ...

    def ask(self, peer: str, query: StatusQuery) -> None:
        """Ask `peer` (over the side channel, authenticated and bounded like a handshake)
        what became of its transfer for `query`; the answer appears in `answers()`."""
        ...

    def answers(self) -> list[tuple[StatusQuery, TransferStatus]]:
        """Questions answered since the last call ("unanswered": no answer in time)."""
        ...


class StatusQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A question to `agent` from `requester`: what became of your transfer for my
    `requester_request_id` (your id for it: `request_id`, "" if I do not know it)?"""

    agent: Annotated[str, msgspec.Meta(max_length=256)]
    requester: Annotated[str, msgspec.Meta(max_length=256)]
    requester_request_id: Annotated[str, msgspec.Meta(max_length=1024)]
    request_id: Annotated[str, msgspec.Meta(max_length=1024)] = ""
