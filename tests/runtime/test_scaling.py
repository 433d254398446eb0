"""Structural properties of the control plane at scale, with no timing assertions.

What keeps the CPU per lifecycle flat from 10 to 10,000 requests in flight, checked by counting:

* a deadline sweep (and an expiry sweep of unmatched registrations) examines the due entries,
  not the pending ones nor the ones of requests that already ended;
* one lifecycle does the same index operations whatever the number in flight, and none of them
  iterates over a whole index (matching a registration is a dict lookup);
* the core holds at most 4 KiB per in-flight request for P and D together (tracemalloc), and
  leaves little for the cycle collector to traverse.
"""

from __future__ import annotations

import gc
import random
from collections import Counter, OrderedDict, deque
from typing import Any

import numpy as np
import pytest

from kvfsm.bench import memory_per_request
from kvfsm.core import (
    Admit,
    Consumer,
    CoreConfig,
    Deadlines,
    Finished,
    HandshakeDone,
    Identity,
    Mode,
    NotificationReceived,
    PostTransfer,
    PrefillFinished,
    Producer,
    SendNotification,
    Side,
    StartHandshake,
    Tick,
    Tombstones,
    TransferResult,
)
from kvfsm.core._matching import PendingRegistrations
from kvfsm.wire import Registration, encode, pack_blocks

MODES: tuple[Mode, ...] = ("push", "pull")
CONFIG = CoreConfig(trace=True)  # history on, as in production


def blocks(i: int) -> np.ndarray:
    return np.array([i], dtype=np.int32)


# --- a back-to-back pair of cores --------------------------------------------------------------


class Pair:
    """A Producer and a Consumer answering each other's commands in place; `hold` keeps transfer
    results and completions back, so requests stay in flight mid-transfer."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.p = Producer(Identity("P"), mode, CONFIG)
        self.d = Consumer(Identity("D"), mode, CONFIG)
        self.hold = False
        self.held: dict[Side, list[Any]] = {self.p: [], self.d: []}  # no tuple per event
        self.finished: list[Finished] = []

    def admit(self, name: str, i: int) -> None:
        """Queue one request on both sides (P admitted and prefilled, D admitted)."""
        pid, did = f"{name}-0000000a", f"{name}-0000000b"
        self.run(
            [
                (self.p, Admit(pid, blocks(i))),
                (self.p, PrefillFinished(pid, blocks(i))),
                (self.d, Admit(did, blocks(i), "P", 1, pid if self.mode == "pull" else "")),
            ]
        )

    def run(self, events: list[tuple[Side, Any]]) -> None:
        queue = deque(events)
        while queue:
            side, event = queue.popleft()
            other = self.d if side is self.p else self.p
            for cmd in side.handle(event, 0.0):
                if isinstance(cmd, SendNotification):
                    queue.append((other, NotificationReceived(side.identity.agent, cmd.payload)))
                elif isinstance(cmd, PostTransfer):
                    result = TransferResult(cmd.request_id, cmd.transfer_id, True)
                    done = NotificationReceived(side.identity.agent, cmd.notification)
                    if self.hold:
                        self.held[side].append(result)
                        self.held[other].append(done)
                    else:
                        queue.extend([(side, result), (other, done)])
                elif isinstance(cmd, StartHandshake):
                    queue.append((side, HandshakeDone(cmd.peer)))
                elif isinstance(cmd, Finished):
                    self.finished.append(cmd)

    def release(self) -> None:
        """Deliver what `hold` kept back."""
        held, self.held = self.held, {self.p: [], self.d: []}
        self.run([(side, event) for side, events in held.items() for event in events])


# --- deadlines -----------------------------------------------------------------------------------


def test_sweep_examines_only_due_deadlines() -> None:
    d = Deadlines()
    n, k, ended = 5000, 7, 3000
    for i in range(ended):  # requests that ended before their deadline: disarmed
        d.arm(f"e{i}", 1.0 + i * 1e-4, "stall_timeout")
    for i in range(k):
        d.arm(f"x{i}", 2.0 + i * 1e-3, "lease_expired")
    for i in range(n):
        d.arm(f"p{i}", 50.0 + i * 1e-3, "lease_expired")
        d.arm(f"q{i}", 60.0 + i * 1e-3, "stall_timeout")
    for i in range(ended):
        d.disarm(f"e{i}")
    before = d.examined
    assert d.due(10.0) == [(f"x{i}", "lease_expired") for i in range(k)]
    # The due entries, plus at most one head per event that stopped the sweep.
    assert d.examined - before <= k + 2
    before = d.examined
    assert d.due(10.0) == []
    assert d.examined - before <= 2
    assert len(d) == 2 * n and d.next_at() == 50.0


def test_deadlines_out_of_order_arms_stay_exact() -> None:
    """Deadlines armed out of time order (a fence, a clock stepped back) fire in time order."""
    rng = random.Random(5)
    d, ref = Deadlines(), dict[str, tuple[float, str]]()
    for i in range(3000):
        key, event = f"k{rng.randrange(500)}", rng.choice(["lease", "stall", "fence"])
        if rng.random() < 0.2:
            d.disarm(key)
            ref.pop(key, None)
            continue
        at = rng.uniform(0, 100) if event == "fence" else i * 0.03
        d.arm(key, at, event)
        ref[key] = (at, event)
    assert d.next_at() == min(at for at, _ in ref.values())
    for now in (10.0, 40.0, 70.0, 1e9):
        before = d.examined
        got = d.due(now)
        want = sorted((at, key) for key, (at, _) in ref.items() if at <= now)
        assert [key for key, _ in got] == [key for _, key in want]
        assert d.examined - before <= len(got) + 4  # the due, plus one head per run
        for key, _ in got:
            del ref[key]
    assert len(d) == 0


@pytest.mark.parametrize("mode", MODES)
def test_tick_examines_only_expired_leases(mode: Mode) -> None:
    p = Producer(Identity("P"), mode, CONFIG)
    lease = CONFIG.lease_s
    for i in range(7):  # leased first: their leases end first
        p.handle(Admit(f"x{i}-0000000a", blocks(i)), 0.0)
        p.handle(PrefillFinished(f"x{i}-0000000a", blocks(i)), 0.0)
    for i in range(3000):
        rid = f"y{i}-0000000a"
        p.handle(Admit(rid, blocks(i)), 5.0)
        p.handle(PrefillFinished(rid, blocks(i)), 5.0)
        if i % 2:  # ended early: its deadline is gone, not left behind for a sweep
            p.handle(
                NotificationReceived("D#0", _registration(rid, f"y{i}-0000000b", i)),
                5.0,
            )
    before = p.deadlines.examined
    ended = [c for c in p.handle(Tick(), lease + 1.0) if isinstance(c, Finished)]
    assert sorted(c.request_id for c in ended) == [f"x{i}-0000000a" for i in range(7)]
    assert {c.state for c in ended} == {"expired"}
    assert p.deadlines.examined - before <= 7 + 3


def _registration(p_id: str, d_id: str, i: int) -> bytes:
    return encode(Registration(p_id, d_id, 0, 1, "D", pack_blocks([i]), 1e9))


def test_registration_expiry_examines_only_expired() -> None:
    pending = PendingRegistrations(capacity=100_000, ttl=30.0)
    for i in range(5000):
        msg = Registration(f"p{i}", f"d{i}", 0, 1, "D", b"", 1e9)
        pending.add(msg, "D#0", 0.0 if i < 5 else 10.0)
    for i in range(5, 3000):  # matched meanwhile: removed at once
        pending.take_for(f"p{i}")
    before = pending.examined
    assert pending.expire(35.0) == [("D#0", f"d{i}") for i in range(5)]
    assert pending.examined - before == 5 + 1
    assert len(pending) == 2000 and pending.next_expiry() == 40.0


# --- index operations per lifecycle ---------------------------------------------------------------


class CountingDict(dict[Any, Any]):
    """A dict that counts its lookups and whole-index iterations, by method."""

    def __init__(self, data: dict[Any, Any], counts: Counter[str], name: str) -> None:
        super().__init__(data)
        self.counts, self.name = counts, name

    def _note(self, op: str) -> None:
        self.counts[f"{self.name}.{op}"] += 1

    def get(self, key: Any, default: Any = None) -> Any:
        self._note("get")
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._note("getitem")
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._note("contains")
        return super().__contains__(key)

    def __iter__(self) -> Any:
        self._note("ITER")
        return super().__iter__()

    def keys(self) -> Any:
        self._note("ITER")
        return super().keys()

    def values(self) -> Any:
        self._note("ITER")
        return super().values()

    def items(self) -> Any:
        self._note("ITER")
        return super().items()


_INDEXES = {
    "p": ["requests", "_waiting", "_waiting_base", "_by_consumer", "_transfers", "peers"],
    "d": ["requests", "_transfers", "peers"],
}


def _lifecycle_ops(mode: Mode, in_flight: int) -> Counter[str]:
    """The index operations of one lifecycle run while `in_flight` others wait mid-transfer."""
    pair = Pair(mode)
    pair.admit("warm", 0)  # peers connected, lifecycles learnt
    pair.hold = True
    for i in range(in_flight):
        pair.admit(f"r{i}", i)
    counts: Counter[str] = Counter()
    for side_name, attrs in _INDEXES.items():
        side = getattr(pair, side_name)
        for attr in attrs:
            setattr(side, attr, CountingDict(getattr(side, attr), counts, f"{side_name}{attr}"))
    pair.hold = False
    finished = len(pair.finished)
    pair.admit("one", 0)
    assert [f.state for f in pair.finished[finished:]] == ["done", "done"]
    return counts


@pytest.mark.parametrize("mode", MODES)
def test_lifecycle_work_does_not_grow_with_requests_in_flight(mode: Mode) -> None:
    few, many = _lifecycle_ops(mode, 3), _lifecycle_ops(mode, 3000)
    assert few == many  # the same lookups, whatever the number waiting
    assert not [op for op in many if op.endswith("ITER")]  # no index is scanned
    # Matching D's registration to P's request is a lookup by id.
    assert many["p_waiting.get"] >= 1


# --- memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_memory_per_request_in_flight_under_4_kib(mode: Mode) -> None:
    # Every request mid-transfer (matched, posted, nothing completed): what the benchmark reports.
    assert memory_per_request(mode, 2000) <= 4096


@pytest.mark.parametrize("mode", MODES)
def test_requests_in_flight_leave_little_for_the_collector(mode: Mode) -> None:
    pair = Pair(mode)
    pair.admit("warm", 0)
    pair.hold = True
    gc.collect()
    before = len(gc.get_objects())
    n = 2000
    for i in range(n):
        pair.admit(f"g{i}", i)
    gc.collect()
    # Requests, tallies and links are Structs the collector does not track (nor the dicts that
    # hold only them); histories are tuples it untracks (a few within two passes of their last
    # transition). Lists as histories would leave 2 per request.
    assert (len(gc.get_objects()) - before) / n <= 0.25
    pair.release()
    assert pair.p.requests == {} and pair.d.requests == {}


# --- tombstones -----------------------------------------------------------------------------------


def test_tombstones_match_an_ordered_reference() -> None:
    rng = random.Random(3)
    cap = 50
    t, ref = Tombstones(cap), OrderedDict[str, str]()
    for i in range(5000):
        key = f"k{rng.randrange(120)}" if rng.random() < 0.3 else f"n{i}"
        t.add(key, f"s{i}")
        ref[key] = f"s{i}"
        ref.move_to_end(key)
        while len(ref) > cap:
            ref.popitem(last=False)
        assert len(t) == len(ref)
    assert all(t.get(k) == v for k, v in ref.items())
    assert sum(f"k{j}" in t for j in range(120)) == sum(f"k{j}" in ref for j in range(120))


# --- matching by base id --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_base_id_index_matches_in_admission_order_and_empties(mode: Mode) -> None:
    """The base-id index holds a request itself when it is the only one of its base (no dict per
    request) and several in admission order otherwise; it holds nothing once none waits."""
    p = Producer(Identity("P"), mode, CONFIG)
    ids = ["r-aaaaaaaa", "r-bbbbbbbb", "r-cccccccc"]
    for rid in ids:
        p.handle(Admit(rid, blocks(1)), 0.0)
    p.handle(Admit("s-dddddddd", blocks(2)), 0.0)
    assert p._waiting_base["s"] is p.requests["s-dddddddd"]
    matched = []
    for i, agent in enumerate(["D#0", "E#0", "F#0"]):
        p.handle(NotificationReceived(agent, _registration("", f"r-{i:08x}", 1)), 0.0)
        matched += [rid for rid in ids if agent in p.requests[rid].links]
        if i == 0:
            assert list(p._waiting_base["r"]) == ids[1:]  # type: ignore[arg-type]
        if i == 1:  # one left: held as itself again
            assert p._waiting_base["r"] is p.requests[ids[2]]
    assert matched == ids
    assert "r" not in p._waiting_base and set(p._waiting_base) == {"s"}
    p.handle(NotificationReceived("G#0", _registration("", "s-00000000", 2)), 0.0)
    assert p._waiting_base == {} and p._waiting == {}
