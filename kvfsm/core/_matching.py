"""Registrations P received for requests it has not admitted yet, indexed for O(1) matching."""

from __future__ import annotations

from collections import OrderedDict

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
    base id; each bounded in number and in time.

    Every registration lives `ttl` from its arrival, so arrival order is expiry order: entries are
    kept in one insertion-ordered map, a sweep pops its head while due (it touches only expired
    entries) and a match removes its entry at once (nothing stale is left for a sweep to skip).
    """

    def __init__(self, capacity: int, ttl: float) -> None:
        self._capacity = capacity
        self._ttl = ttl
        self._entries: OrderedDict[Key, PendingRegistration] = OrderedDict()  # arrival order
        self._by_id: dict[str, dict[Key, None]] = {}
        self._by_base: dict[str, dict[Key, None]] = {}
        self.examined = 0  # entries expiry sweeps looked at (tests check it follows the expired)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def full(self) -> bool:
        """No room for another registration."""
        return len(self._entries) >= self._capacity

    def items(self) -> list[tuple[str, str, float]]:
        """Every kept registration as (sender, D's request id, when it expires), oldest first."""
        return [(sender, rid, entry.expires) for (sender, rid), entry in self._entries.items()]

    def add(self, message: Registration, sender: str, now: float) -> None:
        """Keep `message` until its P request is admitted, or for the time to live."""
        key = (sender, message.sender_request_id)
        if key in self._entries:  # replaced: it expires from its new arrival
            self.drop(key)
        self._entries[key] = PendingRegistration(message, sender, now + self._ttl)
        for index, name in self._names(message):
            index.setdefault(name, {})[key] = None

    def take_for(self, request_id: str) -> list[PendingRegistration]:
        """Remove and return every registration for the P request `request_id`: those naming it,
        else those naming no P id whose D id shares its base id."""
        if not self._entries:  # the usual case: D registers after P admitted
            return []
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
        for entry in self._entries.values():
            return entry.expires
        return None

    def expire(self, now: float) -> list[Key]:
        """Drop the registrations whose time to live is over; return their keys."""
        dropped = []
        entries = self._entries
        while entries:
            key = next(iter(entries))
            self.examined += 1
            if entries[key].expires > now:
                break
            self.drop(key)
            dropped.append(key)
        return dropped

    def _names(self, message: Registration) -> list[tuple[dict[str, dict[Key, None]], str]]:
        names = [(self._by_id, message.sender_request_id)]
        if message.request_id:
            names.append((self._by_id, message.request_id))
        else:
            names.append((self._by_base, base_request_id(message.sender_request_id)))
        # The same index twice with the same name is one entry; indexes compare by identity
        # (two empty dicts are equal, yet by-id and by-base are different places).
        return [
            (index, name)
            for i, (index, name) in enumerate(names)
            if not any(index is seen and name == other for seen, other in names[:i])
        ]
