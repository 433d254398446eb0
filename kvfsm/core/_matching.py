"""Registrations P received for requests it has not admitted yet, indexed for O(1) matching."""

from __future__ import annotations

from collections import deque

import msgspec

from kvfsm.wire import Registration, base_request_id

__all__ = ["PendingRegistration", "PendingRegistrations"]

Key = tuple[str, str]  # (D agent, D's request id)


class PendingRegistration(msgspec.Struct, gc=False):
    """A registration waiting for its P request."""

    message: Registration
    sender: str
    expires: float


class PendingRegistrations:
    """Unmatched registrations, by the P id D named, by D's own id and, when D named no P id, by
    base id; each bounded in number and in time."""

    def __init__(self, capacity: int, ttl: float) -> None:
        self._capacity = capacity
        self._ttl = ttl
        self._entries: dict[Key, PendingRegistration] = {}
        self._by_id: dict[str, dict[Key, None]] = {}
        self._by_base: dict[str, dict[Key, None]] = {}
        self._expiry: deque[tuple[float, Key]] = deque()  # constant ttl: in order

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def full(self) -> bool:
        """No room for another registration."""
        return len(self._entries) >= self._capacity

    def add(self, message: Registration, sender: str, now: float) -> None:
        """Keep `message` until its P request is admitted, or for the time to live."""
        key = (sender, message.sender_request_id)
        self._entries[key] = PendingRegistration(message, sender, now + self._ttl)
        for index, name in self._names(message):
            index.setdefault(name, {})[key] = None
        self._expiry.append((now + self._ttl, key))

    def take_for(self, request_id: str) -> list[PendingRegistration]:
        """Remove and return every registration for the P request `request_id`: those naming it,
        else those naming no P id whose D id shares its base id."""
        keys = self._by_id.get(request_id) or self._by_base.get(base_request_id(request_id))
        return [self.drop(key) for key in list(keys or ())]

    def drop(self, key: Key) -> PendingRegistration:
        """Remove one registration."""
        entry = self._entries.pop(key)
        for index, name in self._names(entry.message):
            keys = index[name]
            del keys[key]
            if not keys:
                del index[name]
        return entry

    def next_expiry(self) -> float | None:
        """When the oldest registration's time to live ends, if any is kept."""
        while self._expiry:
            at, key = self._expiry[0]
            entry = self._entries.get(key)
            if entry is not None and entry.expires == at:
                return at
            self._expiry.popleft()  # matched or dropped already
        return None

    def expire(self, now: float) -> list[Key]:
        """Drop the registrations whose time to live is over; return their keys."""
        dropped = []
        while self._expiry and self._expiry[0][0] <= now:
            _, key = self._expiry.popleft()
            entry = self._entries.get(key)
            if entry is not None and entry.expires <= now:
                self.drop(key)
                dropped.append(key)
        return dropped

    def _names(self, message: Registration) -> list[tuple[dict[str, dict[Key, None]], str]]:
        names = [(self._by_id, message.sender_request_id)]
        if message.request_id:
            names.append((self._by_id, message.request_id))
        else:
            names.append((self._by_base, base_request_id(message.sender_request_id)))
        return [n for i, n in enumerate(names) if n not in names[:i]]
