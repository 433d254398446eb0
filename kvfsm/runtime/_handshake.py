"""The handshake's contract between an engine and its side channel: what a handshake learns of a
peer (`PeerInfo`), how it fails (`HandshakeError`), and how an engine asks for one (`Directory`,
which kvfsm.sidechannel implements over ZMQ and in process)."""

from __future__ import annotations

from typing import Protocol

import msgspec

from kvfsm.layout import RegionLayout

__all__ = ["Directory", "HandshakeError", "PeerInfo"]


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
