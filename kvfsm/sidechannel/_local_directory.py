"""The runtime's `Directory` within one process: engines found by name, handshakes after a set
latency, with fault knobs. The simulated fabric's side channel; `ZmqDirectory` is the real one."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from kvfsm.core import TransferStatus
from kvfsm.runtime import Guests, HandshakeError, PeerInfo, StatusQuery
from kvfsm.sidechannel._clock import clock_offset
from kvfsm.sidechannel._status import StatusAnswerer

__all__ = ["DirectorySnapshot", "DirectoryView", "LocalDirectory"]


class DirectorySnapshot(NamedTuple):
    """The directory's scripted faults still to come, read-only: (peer, how many of the next
    side-channel exchanges with it fail) and (peer, how many hang), peers with none left out;
    and the peers whose side channel is cut."""

    failing: tuple[tuple[str, int], ...]
    hanging: tuple[tuple[str, int], ...]
    cut: tuple[str, ...] = ()


class LocalDirectory:
    """Engines publish how to reach them; a handshake looks the peer up after `latency` seconds of
    `clock`. One directory serves every engine of a simulated cluster; each engine gets its own
    `view`, which keeps that engine's handshakes. `guests` records who handshaked with whom, as
    the engines' listeners would."""

    def __init__(self, clock: Callable[[], float] = lambda: 0.0, latency: float = 0.0) -> None:
        self._engines: dict[str, Callable[[], PeerInfo]] = {}
        self._answerers: dict[str, StatusAnswerer] = {}
        self._cut: set[str] = set()
        self._clocks: dict[str, Callable[[], float]] = {}
        self._failures: Counter[str] = Counter()
        self._hangs: Counter[str] = Counter()
        self._hang_s: dict[str, float] = {}
        self._clock = clock
        self._latency = latency
        self.guests = Guests()

    def view(self, clock: Callable[[], float] | None = None, requester: str = "") -> DirectoryView:
        """A per-engine handle implementing the runtime's `Directory` protocol, for the engine
        of agent `requester` whose clock is `clock` (default: the directory's)."""
        return DirectoryView(self, clock or self._clock, requester)

    def publish(
        self,
        agent: str,
        info: Callable[[], PeerInfo],
        clock: Callable[[], float] | None = None,
        status: StatusAnswerer | None = None,
    ) -> None:
        """Make `agent` reachable; `info` is called at each handshake (metadata may change).
        `clock` is the engine's (default: the directory's): handshakes measure its offset.
        `status` answers peers' questions about transfers (None: they go unanswered)."""
        self._engines[agent] = info
        self._clocks[agent] = clock or self._clock
        if status is not None:
            self._answerers[agent] = status

    def withdraw(self, agent: str) -> None:
        """Make `agent` unreachable (its process is gone)."""
        self._engines.pop(agent, None)
        self._answerers.pop(agent, None)

    def cut(self, agent: str, cut: bool = True) -> None:
        """Cut (or, with `cut=False`, restore) the side channel to `agent`: handshakes with it
        fail and questions to it go unanswered, while its NIXL traffic goes on."""
        if cut:
            self._cut.add(agent)
        else:
            self._cut.discard(agent)

    def snapshot(self) -> DirectorySnapshot:
        """The scripted failures and hangs not yet taken (see `DirectorySnapshot`)."""
        return DirectorySnapshot(
            failing=tuple(sorted((peer, n) for peer, n in self._failures.items() if n)),
            hanging=tuple(sorted((peer, n) for peer, n in self._hangs.items() if n)),
            cut=tuple(sorted(self._cut)),
        )

    def fail_next(self, peer: str, times: int = 1) -> None:
        """Make the next `times` handshakes with `peer` fail."""
        self._failures[peer] += times

    def hang_next(self, peer: str, times: int = 1, seconds: float = 60.0) -> None:
        """Make the next `times` handshakes with `peer` answer only after `seconds`."""
        self._hangs[peer] += times
        self._hang_s[peer] = seconds

    def _answer(self, peer: str) -> PeerInfo:
        info = self._engines.get(peer)
        if info is None or peer in self._cut:
            raise HandshakeError(f"nothing listens for {peer!r}")
        return info()

    def _status(self, query: StatusQuery) -> TransferStatus:
        """The answer to `query` now: a scripted failure (taken here) or a cut side channel
        leaves it unanswered."""
        peer = query.agent
        if self._failures[peer] > 0:
            self._failures[peer] -= 1
            return "unanswered"
        answerer = self._answerers.get(peer)
        if answerer is None or peer in self._cut or peer not in self._engines:
            return "unanswered"
        return answerer(query)

    def peer_clock(self, peer: str) -> float:
        """`peer`'s clock now (the directory's for an engine published without one)."""
        return self._clocks.get(peer, self._clock)()


class DirectoryView:
    """One engine's handshakes through a `LocalDirectory`."""

    def __init__(
        self, directory: LocalDirectory, clock: Callable[[], float], requester: str = ""
    ) -> None:
        self._directory = directory
        self._clock = clock
        self._requester = requester
        # (due, peer, our clock at the start, the peer's clock when the request reaches it,
        # whether it is to fail)
        self._started: list[tuple[float, str, float, float, bool]] = []
        self._asked: list[tuple[float, StatusQuery]] = []  # (due, question), in order asked

    def start(self, peer: str, contact: str = "") -> None:
        """Begin a handshake with `peer`; it finishes after the directory's latency (engines
        are found by name here: `contact` is not needed). A scripted failure or hang is taken
        by the handshake that starts next."""
        d = self._directory
        delay = d._latency
        if d._hangs[peer] > 0:
            d._hangs[peer] -= 1
            delay = d._hang_s[peer]
        failing = d._failures[peer] > 0
        d._failures[peer] -= failing
        reached = d.peer_clock(peer) + d._latency / 2  # a hang is the peer holding the request
        self._started.append((d._clock() + delay, peer, self._clock(), reached, failing))

    def under_way(self) -> list[tuple[float, str, float, float, bool]]:
        """The handshakes started and not finished: (due, peer, our clock at the start, the
        peer's clock when the request reaches it, whether it is to fail)."""
        return list(self._started)

    def next_due(self) -> float | None:
        """When the next handshake or question under way finishes (the directory's clock)."""
        due = [entry[0] for entry in self._started] + [entry[0] for entry in self._asked]
        return min(due, default=None)

    def ask(self, peer: str, query: StatusQuery) -> None:
        """Ask `peer` about a transfer; answered after a round trip of the directory's
        latency, from the peer's state then (a scripted failure or a cut: unanswered)."""
        self._asked.append((self._directory._clock() + self._directory._latency, query))

    def asks_under_way(self) -> list[tuple[float, StatusQuery]]:
        """The questions asked and not answered yet: (due, question)."""
        return list(self._asked)

    def answers(self) -> list[tuple[StatusQuery, TransferStatus]]:
        """The questions whose round trip has passed, with their answers."""
        now = self._directory._clock()
        due = [query for at, query in self._asked if at <= now]
        if not due:
            return []
        self._asked = [entry for entry in self._asked if entry[0] > now]
        return [(query, self._directory._status(query)) for query in due]

    def results(self) -> list[tuple[str, PeerInfo | HandshakeError]]:
        """The handshakes whose latency has passed."""
        now = self._directory._clock()
        due = [entry[1:] for entry in self._started if entry[0] <= now]
        self._started = [entry for entry in self._started if entry[0] > now]
        out: list[tuple[str, PeerInfo | HandshakeError]] = []
        for peer, sent, reached, failing in due:
            try:
                if failing:
                    raise HandshakeError(f"handshake with {peer!r} failed (injected)")
                info = self._directory._answer(peer)
            except HandshakeError as exc:
                out.append((peer, exc))
                continue
            if self._requester:  # as the peer's listener admits whoever it answered
                self._directory.guests.admit(peer, self._requester)
            # As the ZMQ side channel measures it; the answer travels half the latency back.
            answered = self._directory.peer_clock(peer) - self._directory._latency / 2
            offset, error = clock_offset(sent, reached, answered, self._clock())
            out.append(
                (peer, msgspec.structs.replace(info, clock_offset=offset, clock_error=error))
            )
        return out
