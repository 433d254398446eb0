"""The agents that completed a handshake with an engine's listener: its guests.

NIXL delivers a notification from any agent holding this engine's metadata. An engine takes one
only from a peer it completed a handshake with itself (it loaded the peer) or from a guest: an
agent whose handshake request its listener accepted (D's first words to P, a registration, come
before P handshakes back). Shared by a listener's thread and the engines of its process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["MAX_GUESTS", "Guests"]

MAX_GUESTS = 4096
"""Guests remembered per listener: the least recently admitted go first. One forgotten before its
host handshakes back loses only that conversation's first words (its request fails in bounded
time); a peer the host loaded needs no entry."""


class Guests:
    """(host agent, guest agent) pairs a listener admitted, bounded, thread-safe."""

    def __init__(self, limit: int = MAX_GUESTS) -> None:
        self._pairs: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()
        self._limit = limit

    def admit(self, host: str, guest: str) -> None:
        """`guest` completed a handshake for `host` (it holds `host`'s metadata)."""
        with self._lock:
            self._pairs[host, guest] = None
            self._pairs.move_to_end((host, guest))
            if len(self._pairs) > self._limit:
                self._pairs.popitem(last=False)

    def admitted(self, host: str, guest: str) -> bool:
        """Whether `guest` completed a handshake for `host`."""
        with self._lock:
            return (host, guest) in self._pairs

    def pairs(self) -> list[tuple[str, str]]:
        """Every (host, guest) pair remembered, least recently admitted first."""
        with self._lock:
            return list(self._pairs)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pairs)
