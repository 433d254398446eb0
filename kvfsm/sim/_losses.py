"""Notifications lost on purpose at the receiving engine, on either fabric: NIXL delivers
notifications best-effort, and a scenario must be able to lose a given one on real NIXL too,
where nothing can be told to drop a message in flight."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from kvfsm.fabric import Fabric
from kvfsm.wire import WireError, carried, decode

__all__ = ["LossyInbox", "message_kind"]


def message_kind(payload: bytes) -> str:
    """A notification's wire tag ("done", "reg", ...; "" if it is not a readable kvfsm one),
    sealed or not."""
    try:
        message = decode(carried(payload))
    except WireError:
        return ""
    return str(type(message).__struct_config__.tag)


class LossyInbox:
    """`fabric` as an engine sees it, except that notifications reaching it can be lost: the
    next one of a kind (`lose_next`), or all of them until a time (`outage`). Everything else
    is the fabric's own (attribute access passes through)."""

    def __init__(self, fabric: Fabric, clock: Callable[[], float]) -> None:
        self.fabric = fabric
        self._clock = clock
        self._kinds: deque[str] = deque()  # kinds to lose, the next of each, in order
        self._outage_until = -math.inf
        self.lost = 0

    def lose_next(self, kind: str) -> None:
        """Lose the next notification of `kind` (a wire tag) that reaches this agent."""
        self._kinds.append(kind)

    def outage(self, seconds: float) -> None:
        """Lose every notification reaching this agent for `seconds` from now."""
        self._outage_until = self._clock() + seconds

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """The fabric's notifications, less the ones lost on purpose."""
        arrived = self.fabric.get_new_notifs()
        if not self._kinds and self._clock() >= self._outage_until:
            return arrived
        kept: dict[str, list[bytes]] = {}
        for sender, payloads in arrived.items():
            for payload in payloads:
                if self._loses(payload):
                    self.lost += 1
                else:
                    kept.setdefault(sender, []).append(payload)
        return kept

    def _loses(self, payload: bytes) -> bool:
        if self._clock() < self._outage_until:
            return True
        if self._kinds and message_kind(payload) == self._kinds[0]:
            self._kinds.popleft()
            return True
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fabric, name)
