"""An in-process directory of engines: the handshake of the simulated fabric, with a fault knob."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvfsm.runtime._engine import HandshakeError, PeerInfo

__all__ = ["DirectoryView", "LocalDirectory"]


class LocalDirectory:
    """Engines publish how to reach them; a handshake looks the peer up after `latency` seconds of
    `clock`. One directory serves every engine of a simulated cluster; each engine gets its own
    `view`, which keeps that engine's handshakes."""

    def __init__(self, clock: Callable[[], float] = lambda: 0.0, latency: float = 0.0) -> None:
        self._engines: dict[str, Callable[[], PeerInfo]] = {}
        self._failures: Counter[str] = Counter()
        self._hangs: Counter[str] = Counter()
        self._hang_s: dict[str, float] = {}
        self._clock = clock
        self._latency = latency

    def view(self) -> DirectoryView:
        """A per-engine handle implementing the runtime's `Directory` protocol."""
        return DirectoryView(self)

    def publish(self, agent: str, info: Callable[[], PeerInfo]) -> None:
        """Make `agent` reachable; `info` is called at each handshake (metadata may change)."""
        self._engines[agent] = info

    def withdraw(self, agent: str) -> None:
        """Make `agent` unreachable (its process is gone)."""
        self._engines.pop(agent, None)

    def fail_next(self, peer: str, times: int = 1) -> None:
        """Make the next `times` handshakes with `peer` fail."""
        self._failures[peer] += times

    def hang_next(self, peer: str, times: int = 1, seconds: float = 60.0) -> None:
        """Make the next `times` handshakes with `peer` answer only after `seconds`."""
        self._hangs[peer] += times
        self._hang_s[peer] = seconds

    def lookup(self, peer: str) -> PeerInfo:
        """`peer`'s information, or `HandshakeError` if it is unknown or a failure is scripted."""
        if self._failures[peer] > 0:
            self._failures[peer] -= 1
            raise HandshakeError(f"handshake with {peer!r} failed (injected)")
        info = self._engines.get(peer)
        if info is None:
            raise HandshakeError(f"nothing listens for {peer!r}")
        return info()


class DirectoryView:
    """One engine's handshakes through a `LocalDirectory`."""

    def __init__(self, directory: LocalDirectory) -> None:
        self._directory = directory
        self._started: list[tuple[float, str]] = []

    def start(self, peer: str, contact: str = "") -> None:
        """Begin a handshake with `peer`; it finishes after the directory's latency (engines
        are found by name here: `contact` is not needed)."""
        d = self._directory
        delay = d._latency
        if d._hangs[peer] > 0:
            d._hangs[peer] -= 1
            delay = d._hang_s[peer]
        self._started.append((d._clock() + delay, peer))

    def results(self) -> list[tuple[str, PeerInfo | HandshakeError]]:
        """The handshakes whose latency has passed."""
        now = self._directory._clock()
        due = [p for t, p in self._started if t <= now]
        self._started = [(t, p) for t, p in self._started if t > now]
        out: list[tuple[str, PeerInfo | HandshakeError]] = []
        for peer in due:
            try:
                out.append((peer, self._directory.lookup(peer)))
            except HandshakeError as exc:
                out.append((peer, exc))
        return out
