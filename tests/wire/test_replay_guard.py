"""The replay guard against a reference model of senders and a fabric (docs/security.md).

Senders number their notifications, restart under a later epoch, and a fabric delivers them in
any order, loses some, and replays what it carried before. The fabric stays within the bounds
the guard is built for: a notification arrives within the TTL of being numbered or never, and
at most `max_gaps` numbers are outstanding or lost and still waited for. Then every legitimate
notification is taken exactly once, every replay (a duplicate, or a notification from an earlier
epoch than one taken) is refused, and the guard's memory stays within its bounds."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfsm.wire import ReplayGuard

SENDERS = ("P#0", "P#1", "D#0")
MAX_GAPS = 8
TTL = 10.0


@dataclass
class Sent:
    """One notification as its sender numbered it, and what became of it."""

    sender: str
    epoch: int
    seq: int
    sent_at: float
    delivered: bool = False
    taken: bool = False
    opened_at: float | None = None  # when a later number from its sender was taken

    def waited_for(self, now: float) -> bool:
        """Whether the guard may still hold a gap for this number (the bound's accounting)."""
        if self.taken:
            return False
        if self.opened_at is None:
            return not self.delivered  # a gap may yet open for it
        return now < self.opened_at + TTL


class ReplayGuardMachine(RuleBasedStateMachine):
    """Senders, a fabric and the guard, stepped together."""

    def __init__(self) -> None:
        super().__init__()
        self.guard = ReplayGuard(limit=len(SENDERS), max_gaps=MAX_GAPS, gap_ttl_s=TTL)
        self.now = 0.0
        self.epoch = dict.fromkeys(SENDERS, 1)
        self.next_seq = dict.fromkeys(SENDERS, 1)
        self.newest_epoch_taken = dict.fromkeys(SENDERS, 0)
        self.sent: list[Sent] = []

    def _in_flight(self) -> list[Sent]:
        return [m for m in self.sent if not m.delivered and self.now < m.sent_at + TTL]

    @precondition(lambda self: sum(m.waited_for(self.now) for m in self.sent) < MAX_GAPS)
    @rule(sender=st.sampled_from(SENDERS))
    def send(self, sender: str) -> None:
        self.sent.append(Sent(sender, self.epoch[sender], self.next_seq[sender], self.now))
        self.next_seq[sender] += 1

    @rule(sender=st.sampled_from(SENDERS))
    def restart(self, sender: str) -> None:
        self.epoch[sender] += 1
        self.next_seq[sender] = 1

    @rule(dt=st.floats(0.0, TTL / 2))
    def advance(self, dt: float) -> None:
        """Time passes; what the fabric held a TTL long is lost."""
        self.now += dt

    @precondition(lambda self: self._in_flight())
    @rule(pick=st.integers(0, 1 << 16))
    def deliver(self, pick: int) -> None:
        """The fabric delivers one notification it holds, in any order."""
        flights = self._in_flight()
        m = flights[pick % len(flights)]
        m.delivered = True
        taken = self._check(m)
        legitimate = m.epoch >= self.newest_epoch_taken[m.sender]
        assert taken == legitimate, (m, self.newest_epoch_taken)
        if taken:
            self._took(m)

    @precondition(lambda self: any(m.delivered for m in self.sent))
    @rule(pick=st.integers(0, 1 << 16))
    def replay(self, pick: int) -> None:
        """Someone sends again what the fabric carried before: always refused."""
        carried = [m for m in self.sent if m.delivered]
        assert not self._check(carried[pick % len(carried)])

    def _check(self, m: Sent) -> bool:
        return self.guard.check(m.sender, m.epoch, m.seq, self.now) is None

    def _took(self, m: Sent) -> None:
        m.taken = True
        self.newest_epoch_taken[m.sender] = m.epoch
        for other in self.sent:
            same = other.sender == m.sender and other.epoch == m.epoch
            if same and other.seq < m.seq and other.opened_at is None:
                other.opened_at = self.now

    @invariant()
    def memory_is_bounded(self) -> None:
        assert self.guard.gaps <= MAX_GAPS
        assert self.guard.senders <= len(SENDERS)

    @invariant()
    def nothing_taken_twice(self) -> None:
        taken = [(m.sender, m.epoch, m.seq) for m in self.sent if m.taken]
        assert len(taken) == len(set(taken))


TestReplayGuard = ReplayGuardMachine.TestCase


def test_memory_stays_bounded_under_a_flood_of_jumps() -> None:
    """A sender (holding the secret) jumping far ahead, again and again, opens at most
    `max_gaps` gaps in all; what was pushed out is refused, never taken twice."""
    guard = ReplayGuard(limit=4, max_gaps=64, gap_ttl_s=TTL)
    for step in range(1, 200):
        assert guard.check(SENDERS[step % 3], 1, step * 1_000_000, now=0.0) is None
        assert guard.gaps <= 64 and guard.senders <= 3
    assert guard.check(SENDERS[1], 1, 1, now=0.0) is not None  # pushed out long ago: refused
