"""The simulated network's virtual clock and event heap, and the fate of what it delivers.

`_FaultyClock` is the base of `kvfsm.fabric._sim.SimNetwork`: it owns the clock, the heap of
future events keyed by (time, sequence number), the fate of every notification (latency, drop,
duplicate, delay, reorder, hold) drawn from the knobs of `_sim_faults`, and the public faces a
model checker drives it by (`snapshot`, `withdraw_event`, `add_event`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from kvfsm.fabric._protocol import FabricError
from kvfsm.fabric._sim_faults import (
    MIN_DELAYED_POST,
    POST_OUTCOMES,
    PostOutcome,
    SimFaults,
    SimStats,
    _Dice,
)
from kvfsm.fabric._sim_rows import Xfer

__all__ = ["NetworkSnapshot"]


@dataclass(slots=True)
class _Notif:
    """A notification on its way; faults may swap payloads between two of them."""

    sender: str
    sender_gen: int
    receiver_gen: int
    msg: bytes


@dataclass(slots=True)
class _Completion:
    """A transfer due to complete (or fail) at its scheduled time."""

    gen: int  # initiator incarnation
    handle: int
    post: int  # the post it belongs to: a stale one (handle re-posted or released) is ignored
    fail_rows: int | None  # None: succeed; k: copy k rows then end "ERR"


@dataclass(slots=True)
class _LateBytes:
    """A transfer released in progress whose bytes are still on their way (`late_delivery`)."""

    gen: int  # initiator incarnation
    xfer: Xfer  # released


class NetworkSnapshot(NamedTuple):
    """What a simulated network will do next, read-only: its pending events as (due, seq,
    event) in delivery order (notifications, transfer completions, late bytes) and the post
    outcomes scripted per agent. `kvfsm check` fingerprints it and enumerates faults over it."""

    events: tuple[tuple[float, int, object], ...]
    scripted_posts: tuple[tuple[str, tuple[PostOutcome, ...]], ...]


class _FaultyClock:
    """Virtual clock, event heap, notification faults and scripted injections of a network."""

    def __init__(self, seed: int, faults: SimFaults | None) -> None:
        self._faults = faults if faults is not None else SimFaults()
        self._dice = _Dice(seed, self._faults)
        self._now = 0.0
        self._stats = SimStats()
        self._seq = itertools.count()
        self._events: list[tuple[float, int, object]] = []
        self._held: dict[str, list[_Notif]] = {}

    # Hooks for the network.
    def _on_completion(self, event: _Completion) -> None:
        raise NotImplementedError

    def _deliver(self, notif: _Notif) -> None:
        raise NotImplementedError

    def _land_late(self, event: _LateBytes) -> None:
        raise NotImplementedError

    def _is_live(self, name: str) -> bool:
        raise NotImplementedError

    def _is_known(self, name: str) -> bool:
        raise NotImplementedError

    @property
    def now(self) -> float:
        """The virtual clock, in seconds (starts at 0)."""
        return self._now

    @property
    def faults(self) -> SimFaults:
        """The probabilistic fault configuration."""
        return self._faults

    @property
    def stats(self) -> SimStats:
        """A snapshot of the counters."""
        return replace(self._stats)

    def snapshot(self) -> NetworkSnapshot:
        """The pending events and scripted post outcomes (see `NetworkSnapshot`)."""
        return NetworkSnapshot(
            events=tuple(sorted(self._events, key=lambda e: (e[0], e[1]))),
            scripted_posts=tuple(
                (agent, tuple(q)) for agent, q in sorted(self._dice.scripted_posts().items()) if q
            ),
        )

    def withdraw_event(self, seq: int) -> tuple[float, object]:
        """Remove the pending event numbered `seq` (from `snapshot`): a message dropped, a
        transfer that never completes. Returns its due time and the event."""
        entry = next(e for e in self._events if e[1] == seq)
        self._events.remove(entry)
        heapq.heapify(self._events)
        return entry[0], entry[2]

    def add_event(self, when: float, event: object) -> None:
        """Schedule an event taken from `snapshot` (or a copy of one) at `when`: a delivery
        delayed or duplicated."""
        self._schedule(when, event)

    def advance_to(self, t: float) -> None:
        """Move the clock to `t`, processing every event due by then in (time, seq) order."""
        if not math.isfinite(t) or t < self._now:
            raise ValueError(f"cannot move the clock from {self._now} to {t}")
        while self._events and self._events[0][0] <= t:
            when, _, event = heapq.heappop(self._events)
            self._now = when  # follow-up events are scheduled from the event's own time
            if isinstance(event, _Notif):
                self._deliver(event)
            elif isinstance(event, _LateBytes):
                self._land_late(event)
            else:
                assert isinstance(event, _Completion)
                self._on_completion(event)
        self._now = t

    def advance(self, dt: float) -> None:
        """Move the clock forward by `dt` seconds."""
        self.advance_to(self._now + dt)

    def next_event_time(self) -> float | None:
        """When the next scheduled event is due, or None."""
        return self._events[0][0] if self._events else None

    def run_until_idle(self) -> float:
        """Advance until no event is scheduled (stuck transfers schedule none); returns now."""
        while self._events:
            self.advance_to(self._events[0][0])
        return self._now

    def pending_notifs(self) -> int:
        """Notifications scheduled or held, not yet delivered or dropped."""
        held = sum(len(v) for v in self._held.values())
        return held + sum(isinstance(e, _Notif) for _, _, e in self._events)

    def inject_next_post(self, agent: str, outcome: PostOutcome) -> None:
        """Script the outcome of `agent`'s next `transfer()` (queued FIFO).

        ``"fail_post"``: raises `FabricError`; ``"err"``: ends ``"ERR"`` with a random prefix of
        rows copied and no notification; ``"stuck"``: ``"PROC"`` until released; ``"delay"``:
        completes normally after ``max(transfer_latency, 1e-3)``.
        """
        if not self._is_live(agent):
            raise ValueError(f"no live agent named {agent!r}")
        if outcome not in POST_OUTCOMES:
            raise ValueError(f"unknown post outcome {outcome!r}")
        self._dice.script_post(agent, outcome)

    def drop_next_notif(self, receiver: str) -> None:
        """Lose the next notification sent to `receiver` (scripted actions queue FIFO)."""
        self._dice.script_notif(self._known(receiver), "drop")

    def duplicate_next_notif(self, receiver: str) -> None:
        """Deliver the next notification sent to `receiver` twice."""
        self._dice.script_notif(self._known(receiver), "duplicate")

    def delay_next_notif(self, receiver: str, seconds: float) -> None:
        """Delay the next notification sent to `receiver` by `seconds` on top of the latency."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"delay must be finite and >= 0, got {seconds!r}")
        self._dice.script_notif(self._known(receiver), float(seconds))

    def hold_notifs(self, receiver: str) -> None:
        """Queue the notifications reaching `receiver` instead of delivering them."""
        self._held.setdefault(self._known(receiver), [])

    def release_held(self, receiver: str, reverse: bool = False) -> int:
        """Stop holding; deliver what was held now (reversed if asked). Returns how many."""
        held = self._held.pop(receiver, [])
        for n in reversed(held) if reverse else held:
            self._deliver(n)
        return len(held)

    def _known(self, name: str) -> str:
        if not self._is_known(name):
            raise ValueError(f"no agent named {name!r}")
        return name

    def _schedule(self, when: float, event: object) -> None:
        heapq.heappush(self._events, (when, next(self._seq), event))

    def _plan_post(self, agent: str, rows: int) -> tuple[float | None, int | None]:
        """Fate of one `transfer()` of `rows` pairs by `agent`: ``(latency, fail_rows)``.

        Raises `FabricError` for a failed post; latency None: stuck; fail_rows not None: the
        transfer ends ``"ERR"`` after copying that many rows.
        """
        self._stats.posts += 1
        outcome = self._dice.post_outcome(agent)
        if outcome == "fail_post":
            self._stats.posts_failed += 1
            raise FabricError(f"posting a transfer of {agent!r} failed (injected fault)")
        if outcome == "stuck":
            return None, None
        latency = self._faults.transfer_latency
        if outcome == "delay":
            latency = max(latency, MIN_DELAYED_POST)
        return latency, self._dice.partial_rows(rows) if outcome == "err" else None

    def _send_notif(self, notif: _Notif, receiver: str, reachable: bool) -> None:
        """Send one notification: count it, decide its fate, schedule its delivery(ies)."""
        self._stats.notifs_sent += 1
        plan = self._dice.notif_plan(receiver)
        if not reachable or plan.drop:
            self._stats.notifs_dropped += 1
            return
        when = self._now + self._faults.notif_latency + plan.extra_delay
        slot_time, carrier = when, notif  # where our payload ends up after any reordering
        if plan.reorder:
            # Overtake the latest pending notification to the same receiver due before us by
            # swapping payloads: both due times stay in the future, hence after any DONE.
            earlier = [
                (t, s, e)
                for t, s, e in self._events
                if isinstance(e, _Notif) and e.receiver_gen == notif.receiver_gen and t <= when
            ]
            if earlier:
                slot_time, _, other = max(earlier, key=lambda item: (item[0], item[1]))
                assert isinstance(other, _Notif)  # filtered above; narrows for mypy
                carrier = other
                notif.sender, carrier.sender = carrier.sender, notif.sender
                notif.sender_gen, carrier.sender_gen = carrier.sender_gen, notif.sender_gen
                notif.msg, carrier.msg = carrier.msg, notif.msg
        self._schedule(when, notif)
        if plan.duplicate:
            self._stats.notifs_duplicated += 1
            self._schedule(slot_time, replace(carrier))  # the copy follows the original
