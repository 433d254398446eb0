"""The public snapshots `kvfsm check` fingerprints states with: each one changes when the state it
covers changes, so a state the check must tell apart is never folded into another."""

from __future__ import annotations

from kvfsm.fabric import SimFaults
from kvfsm.sidechannel import DirectoryView
from kvfsm.sim import Cluster


def test_side_snapshot_follows_deadlines_tombstones_and_matches() -> None:
    c = Cluster(mode="push")
    p, d = (c.engines[c.agents(side)[0]].side for side in ("P", "D"))
    before = (p.snapshot(), d.snapshot())
    c.admit("r1", 2)
    c.step(0.005)
    # The watchdog, and the question to P due before it (a lost completion's recovery).
    events = [event for _, event, _ in d.snapshot().deadlines]
    assert events == ["watchdog_expired", "completion_overdue"]
    c.finish_prefill("r1")
    c.settle()
    p_end, d_end = p.snapshot(), d.snapshot()
    assert (p_end, d_end) != before and not p_end.deadlines and not d_end.deadlines
    assert [state for _, state in p_end.tombstones] == ["done"] == [s for _, s in d_end.tombstones]
    assert p_end.consumed and p_end.ended_bases == ("r1",) and p_end.next_peer_sweep is not None
    assert d_end.next_heartbeat is not None and p_end.next_heartbeat is None


def test_engine_routes_and_directory_handshakes_appear_and_end() -> None:
    c = Cluster(mode="push", handshake_latency=0.01)
    d = c.engines[c.agents("D")[0]]
    assert d.routes() == ()
    c.admit("r1", 2)
    c.step(0.005)
    view = d.directory
    assert isinstance(view, DirectoryView)
    assert [peer for _, peer, *_ in view.under_way()] == ["P#0"]
    c.step(0.01)
    assert d.routes() == ("P#0",) and not view.under_way()


def test_network_snapshot_holds_pending_events_and_scripted_posts() -> None:
    c = Cluster(mode="push", faults=SimFaults(transfer_latency=0.5))
    p = c.agents("P")[0]
    c.network.inject_next_post(p, "err")
    assert c.network.snapshot().scripted_posts == ((p, ("err",)),)
    key = "r1"
    c.admit(key, 2)
    c.finish_prefill(key)
    while not c.network.snapshot().events:
        c.step(0.01)
    when, seq, _ = c.network.snapshot().events[0]
    assert c.network.withdraw_event(seq)[0] == when
    assert seq not in {s for _, s, _ in c.network.snapshot().events}


def test_directory_snapshot_counts_scripted_failures() -> None:
    c = Cluster(mode="push")
    c.directory.fail_next("P#0", times=2)
    c.directory.hang_next("P#0")
    c.directory.cut("D#0")
    assert c.directory.snapshot() == ((("P#0", 2),), (("P#0", 1),), ("D#0",))


def test_ledger_books_record_releases_and_receptions() -> None:
    c = Cluster(mode="push")
    before = c.ledger.snapshot()
    key = "r1"
    c.admit(key, 2)
    c.finish_prefill(key)
    c.settle()
    after = c.ledger.snapshot()
    assert after != before and after.received and after.released
