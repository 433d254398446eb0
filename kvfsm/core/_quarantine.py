"""Blocks held after their request ended, while a given-up transfer's bytes may still land.

A released NIXL handle stops a transfer on RDMA and shared memory, but not on UCX's TCP transport:
bytes already in the sender's kernel socket are delivered whenever the link allows, until the
kernel gives the connection up (`UCX_TCP_USER_TIMEOUT`). D therefore keeps the blocks of a request
that ended without receiving everything for the transport's drain bound before handing them back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvfsm.wire import BlockIds

__all__ = ["Quarantine"]


class Quarantine:
    """Held blocks by release time. Every hold is `now + the drain bound`, so they arrive in time
    order and a deque is enough; memory is bounded by the blocks D owns (each is held at most once)."""

    def __init__(self) -> None:
        self._held: deque[tuple[float, str, BlockIds]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[tuple[float, str, BlockIds]]:
        """The holds, earliest end first: (until, request id, blocks)."""
        return iter(self._held)

    def hold(self, until: float, request_id: str, blocks: BlockIds) -> None:
        """Keep `blocks` of `request_id` until `until`."""
        self._held.append((until, request_id, blocks))

    def next_at(self) -> float | None:
        """When the earliest hold ends, if any."""
        return self._held[0][0] if self._held else None

    def due(self, now: float) -> list[tuple[str, BlockIds]]:
        """Take the holds that ended by `now` (all of them if `now` is infinite)."""
        out = []
        while self._held and self._held[0][0] <= now:
            _, request_id, blocks = self._held.popleft()
            out.append((request_id, blocks))
        return out

    def holds(self, request_id: str) -> bool:
        """Whether `request_id`'s blocks are held (a scan: for tests and probes)."""
        return any(rid == request_id for _, rid, _ in self)
