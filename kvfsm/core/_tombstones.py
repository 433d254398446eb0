"""What a side remembers of finished requests, so that a late message for one is told apart from
a message for an id it never knew."""

from __future__ import annotations

from collections import deque

__all__ = ["Tombstones"]


class Tombstones:
    """A bounded memory of finished ids and how they ended, to tell late messages from unknown ones.

    A dict with a FIFO of its keys (cheaper than an `OrderedDict`: one add is a dict store and a
    deque append). Re-adding a key makes it the newest: its older place in the FIFO is counted
    in `_moved` and skipped when it comes up (re-adds are rare: a cancel after a registration).
    """

    def __init__(self, capacity: int) -> None:
        self._ended: dict[str, str] = {}
        self._order: deque[str] = deque()  # keys, oldest first
        self._moved: dict[str, int] = {}  # key -> older places of it still in `_order`
        self._capacity = capacity

    def __contains__(self, key: object) -> bool:
        return key in self._ended

    def __len__(self) -> int:
        return len(self._ended)

    def add(self, key: str, state: str) -> None:
        """Remember that `key` ended in `state`; forget the oldest beyond capacity."""
        ended = self._ended
        size = len(ended)
        ended.setdefault(key, state)  # one lookup for a new key, the usual case
        if len(ended) == size:  # re-added
            ended[key] = state
            self._moved[key] = self._moved.get(key, 0) + 1
        self._order.append(key)
        while len(ended) > self._capacity:
            old = self._order.popleft()
            moved = self._moved.get(old)
            if moved is None:
                del ended[old]
            elif moved > 1:
                self._moved[old] = moved - 1
            else:
                del self._moved[old]

    def get(self, key: str) -> str | None:
        """How `key` ended, if remembered."""
        return self._ended.get(key)

    def items(self) -> list[tuple[str, str]]:
        """Every remembered (key, how it ended), oldest first."""
        return list(self._ended.items())
