"""Deadlines: one per key, removed eagerly, swept touching only the entries that are due.

Every deadline the core arms is `now + a constant of its kind` (a lease, a stall bound, a watchdog),
so the deadlines of one event arrive in time order. Each event therefore keeps a *run*: an
insertion-ordered map whose head is its earliest deadline. Arming appends to a run and disarming
deletes from it, both O(1); a sweep pops each run's head while it is due, so it examines the due
entries plus one head per run, never an entry that is not due and never a stale one (there are
none: nothing is left behind to be skipped later, unlike a heap with lazy deletion).

The few deadlines that arrive out of order (a fence bounded by an earlier registration's deadline,
a clock stepped back by a test) go to a sorted overflow list instead: O(log n) to find, a memmove
to insert or delete, still swept from its front.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections import OrderedDict

__all__ = ["Deadlines", "earliest"]

_AT = operator.itemgetter(0)


class _Run:
    """The deadlines of one event, in time order: key -> at."""

    __slots__ = ("entries", "event", "last")

    def __init__(self, event: str) -> None:
        self.event = event
        self.entries: OrderedDict[str, float] = OrderedDict()
        self.last = -math.inf  # the latest deadline appended (a bound on the tail's)


class Deadlines:
    """One deadline per key (an instance id), firing an event when its time comes.

    Deadlines that fall at the same time fire grouped by event, each group in the order armed.

    `examined` counts the entries sweeps have looked at (due ones, plus one head per run that
    stopped a sweep): tests use it to check that a sweep's cost follows the due entries only.
    """

    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}
        # Out-of-order deadlines, sorted by (at, key): a sorted list is also a valid min-heap.
        self._heap: list[tuple[float, str, str]] = []
        self._where: dict[str, _Run | tuple[float, str, str]] = {}  # its run or overflow entry
        self.examined = 0

    def __len__(self) -> int:
        return len(self._where)

    def armed(self) -> list[tuple[str, str, float]]:
        """Every armed deadline as (key, event, at), in no particular order."""
        return [
            (key, where.event, where.entries[key])
            if isinstance(where, _Run)
            else (key, where[2], where[0])
            for key, where in self._where.items()
        ]

    def at(self, key: str) -> float | None:
        """When `key`'s deadline falls, if armed."""
        where = self._where.get(key)
        if where is None:
            return None
        return where.entries[key] if isinstance(where, _Run) else where[0]

    def arm(self, key: str, at: float, event: str) -> None:
        """Set `key`'s deadline to `at`, firing `event`; replaces any earlier one."""
        self.disarm(key)  # one lookup whether or not it was armed
        run = self._runs.get(event)
        if run is None:
            run = self._runs[event] = _Run(event)
        if at >= run.last:
            run.entries[key] = at
            run.last = at
            self._where[key] = run
        else:
            entry = (at, key, event)
            bisect.insort(self._heap, entry)
            self._where[key] = entry

    def disarm(self, key: str) -> None:
        """Forget `key`'s deadline (a no-op if it has none)."""
        where = self._where.pop(key, None)
        if where is None:
            return
        if isinstance(where, _Run):
            del where.entries[key]
            if not where.entries:  # the next deadline of its event starts a new run
                del self._runs[where.event]
            return
        del self._heap[bisect.bisect_left(self._heap, where)]

    def due(self, now: float) -> list[tuple[str, str]]:
        """Remove and return every deadline at or before `now` as (key, event), earliest first."""
        found: list[tuple[float, str, str]] = []
        where = self._where
        for event, run in list(self._runs.items()):
            entries = run.entries
            while entries:
                key = next(iter(entries))
                at = entries[key]
                self.examined += 1
                if at > now:
                    break
                del entries[key], where[key]
                found.append((at, key, event))
            if not entries:
                del self._runs[event]
        heap = self._heap
        taken = 0
        for entry in heap:
            self.examined += 1
            if entry[0] > now:
                break
            del where[entry[1]]
            taken += 1
        if taken:
            found.extend(heap[:taken])
            del heap[:taken]
        if not found:  # the usual sweep: an event loop ticks after every poll
            return []
        found.sort(key=_AT)  # stable, over sorted runs: a merge, linear in the number found
        return [(key, event) for _, key, event in found]

    def next_at(self) -> float | None:
        """When the earliest deadline falls, if any (for an event loop's timeout)."""
        at = self._heap[0][0] if self._heap else None
        for run in self._runs.values():  # a run is deleted when it empties: each has a head
            head = next(iter(run.entries.values()))
            if at is None or head < at:
                at = head
        return at


def earliest(*times: float | None) -> float | None:
    """The earliest of the `times` that are set; None if none is. (An event loop asks for its
    next wakeup after every poll: this runs without building a list or a generator.)"""
    at = None
    for t in times:
        if t is not None and (at is None or t < at):
            at = t
    return at
