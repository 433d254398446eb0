"""An in-process directory of engines: the handshake of the simulated fabric, with a fault knob."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvfsm.runtime._engine import HandshakeError, PeerInfo

__all__ = ["LocalDirectory"]


class LocalDirectory:
    """Engines publish how to reach them; a handshake looks the peer up."""

    def __init__(self) -> None:
        self._engines: dict[str, Callable[[], PeerInfo]] = {}
        self._failures: Counter[str] = Counter()

    def publish(self, agent: str, info: Callable[[], PeerInfo]) -> None:
        """Make `agent` reachable; `info` is called at each handshake (metadata may change)."""
        self._engines[agent] = info

    def withdraw(self, agent: str) -> None:
        """Make `agent` unreachable (its process is gone)."""
        self._engines.pop(agent, None)

    def fail_next(self, peer: str, times: int = 1) -> None:
        """Make the next `times` handshakes with `peer` fail."""
        self._failures[peer] += times

    def handshake(self, peer: str) -> PeerInfo:
        """`peer`'s information, or `HandshakeError` if it is unknown or a failure is scripted."""
        if self._failures[peer] > 0:
            self._failures[peer] -= 1
            raise HandshakeError(f"handshake with {peer!r} failed (injected)")
        info = self._engines.get(peer)
        if info is None:
            raise HandshakeError(f"nothing listens for {peer!r}")
        return info()
