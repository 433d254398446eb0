"""Tests of the simulated fabric's faults (`SimFaults`, scripted injections), peer death and
revival, resources and determinism."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.fabric import (
    FabricError,
    NotFoundError,
    RemoteDisconnectedError,
    RepostError,
    SimFaults,
    SimNetwork,
    SimStats,
    XferHandle,
)
from tests.fabric.sim_pair import LAT, Pair, assert_balanced, descs, make_pair

# --- probabilistic faults --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"drop_notif": 1.5},
        {"xfer_err": -0.1},
        {"notif_latency": 0.0},
        {"transfer_latency": -1.0},
        {"max_notif_delay": float("inf")},
    ],
)
def test_sim_faults_validates_its_knobs(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SimFaults(**kwargs)


def test_fault_drop_notif() -> None:
    p = make_pair(drop_notif=1.0)
    p.a.send_notif("b", b"x")
    assert p.a.transfer(p.xfer(notif=b"y")) == "DONE"  # the data still lands
    p.net.run_until_idle()
    assert p.b.get_new_notifs() == {}
    assert p.net.stats.notifs_dropped == 2
    np.testing.assert_array_equal(p.bbuf[:16], p.abuf[:16])
    assert_balanced(p.net)


def test_fault_duplicate_notif() -> None:
    p = make_pair(duplicate_notif=1.0)
    p.a.send_notif("b", b"x")
    p.net.run_until_idle()
    assert p.b.get_new_notifs() == {"a": [b"x", b"x"]}
    assert p.net.stats.notifs_duplicated == 1
    assert_balanced(p.net)


def test_fault_delay_notif() -> None:
    p = make_pair(seed=3, delay_notif=1.0, max_notif_delay=0.5)
    p.a.send_notif("b", b"x")
    due = p.net.next_event_time()
    assert due is not None and LAT < due <= LAT + 0.5
    p.net.advance_to(LAT)
    assert p.b.get_new_notifs() == {}
    p.net.advance_to(due)
    assert p.b.get_new_notifs() == {"a": [b"x"]}


def test_fault_reorder_notif() -> None:
    p = make_pair(reorder_notif=1.0)
    p.a.send_notif("b", b"1")
    p.a.send_notif("b", b"2")
    p.a.send_notif("b", b"3")
    p.net.run_until_idle()
    # Each one overtakes the latest earlier undelivered one.
    assert p.b.get_new_notifs() == {"a": [b"2", b"3", b"1"]}


def test_fault_reorder_keeps_transfer_notifications_after_done() -> None:
    p = make_pair(reorder_notif=1.0, transfer_latency=0.01)
    p.a.send_notif("b", b"early")
    h = p.xfer(notif=b"xfer")
    p.a.transfer(h)
    p.net.advance_to(0.01)
    assert p.a.check_xfer_state(h) == "DONE"
    assert p.b.get_new_notifs() == {"a": [b"early"]}
    p.net.run_until_idle()
    assert p.b.get_new_notifs() == {"a": [b"xfer"]}


def test_fault_fail_post() -> None:
    p = make_pair(fail_post=1.0)
    h = p.xfer()
    with pytest.raises(FabricError, match="injected"):
        p.a.transfer(h)
    assert not p.bbuf.any()
    with pytest.raises(FabricError, match="never posted"):
        p.a.check_xfer_state(h)  # the handle keeps its state
    assert p.net.stats.posts == 1 and p.net.stats.posts_failed == 1


def test_fault_xfer_err_copies_at_most_a_prefix_and_never_notifies() -> None:
    p = make_pair(seed=5, xfer_err=1.0)
    blocks = [(i * 4, 4) for i in range(16)]
    h = p.xfer(blocks=blocks, notif=b"n")
    assert p.a.transfer(h) == "ERR"
    assert p.a.check_xfer_state(h) == "ERR"
    copied = [bool((p.bbuf[o : o + n] == p.abuf[o : o + n]).all()) for o, n in blocks]
    untouched = [not p.bbuf[o : o + n].any() for o, n in blocks]
    k = copied.index(False)
    assert all(copied[:k]) and all(untouched[k:])
    p.net.run_until_idle()
    assert p.b.get_new_notifs() == {}
    assert p.net.stats.xfers_err == 1 and p.net.stats.bytes_moved == 0


def test_fault_xfer_err_with_latency_ends_err_later() -> None:
    p = make_pair(xfer_err=1.0, transfer_latency=0.01)
    h = p.xfer()
    assert p.a.transfer(h) == "PROC"
    p.net.advance(0.01)
    assert p.a.check_xfer_state(h) == "ERR"


def test_fault_xfer_stuck() -> None:
    p = make_pair(xfer_stuck=1.0)
    h = p.xfer()
    assert p.a.transfer(h) == "PROC"
    p.net.advance_to(1e6)
    assert p.a.check_xfer_state(h) == "PROC"
    assert p.a.in_flight() == 1
    assert not p.bbuf.any()
    p.a.release_xfer_handle(h)
    assert p.a.in_flight() == 0


def test_fractional_probabilities_are_seeded() -> None:
    def run(seed: int) -> tuple[list[bytes], SimStats]:
        p = make_pair(seed=seed, drop_notif=0.5)
        for i in range(200):
            p.a.send_notif("b", str(i).encode())
        p.net.run_until_idle()
        return p.b.get_new_notifs()["a"], p.net.stats

    got, stats = run(7)
    assert 50 < len(got) < 150 and stats.notifs_dropped == 200 - len(got)
    assert run(7) == (got, stats)
    assert run(8)[0] != got


# --- scripted injections ---------------------------------------------------------------------


def test_inject_next_post_outcomes_apply_once_in_order() -> None:
    p = make_pair()
    p.net.inject_next_post("a", "fail_post")
    p.net.inject_next_post("a", "err")
    h = p.xfer()
    with pytest.raises(FabricError):
        p.a.transfer(h)
    assert p.a.transfer(h) == "ERR"
    assert p.a.transfer(h) == "DONE"  # the script is used up


def test_inject_next_post_stuck_and_delay() -> None:
    p = make_pair()
    p.net.inject_next_post("a", "stuck")
    h = p.xfer()
    assert p.a.transfer(h) == "PROC"
    p.net.run_until_idle()
    assert p.a.check_xfer_state(h) == "PROC"
    p.a.release_xfer_handle(h)
    p.net.inject_next_post("a", "delay")
    h2 = p.xfer(notif=b"n")
    assert p.a.transfer(h2) == "PROC"
    p.net.advance(0.5e-3)
    assert p.a.check_xfer_state(h2) == "PROC"
    p.net.advance(0.5e-3)
    assert p.a.check_xfer_state(h2) == "DONE"
    np.testing.assert_array_equal(p.bbuf[:16], p.abuf[:16])


def test_inject_next_post_only_affects_that_agent() -> None:
    p = make_pair()
    p.net.inject_next_post("b", "fail_post")
    assert p.a.transfer(p.xfer()) == "DONE"
    with pytest.raises(ValueError):
        p.net.inject_next_post("nobody", "err")
    with pytest.raises(ValueError):
        p.net.inject_next_post("a", "explode")  # type: ignore[arg-type]


def test_scripted_notification_faults() -> None:
    p = make_pair()
    p.net.drop_next_notif("b")
    p.net.duplicate_next_notif("b")
    p.net.delay_next_notif("b", 1.0)
    for m in (b"dropped", b"twice", b"late", b"plain"):
        p.a.send_notif("b", m)
    p.net.advance(LAT)
    assert p.b.get_new_notifs() == {"a": [b"twice", b"twice", b"plain"]}
    p.net.advance(1.0)
    assert p.b.get_new_notifs() == {"a": [b"late"]}
    assert p.net.stats.notifs_dropped == 1 and p.net.stats.notifs_duplicated == 1
    assert_balanced(p.net)
    with pytest.raises(ValueError):
        p.net.drop_next_notif("nobody")
    with pytest.raises(ValueError):
        p.net.delay_next_notif("b", -1.0)


@pytest.mark.parametrize("reverse", [False, True])
def test_hold_and_release_reorders(reverse: bool) -> None:
    p = make_pair()
    p.net.hold_notifs("b")
    p.a.send_notif("b", b"1")
    p.a.send_notif("b", b"2")
    p.a.transfer(p.xfer(notif=b"3"))
    p.net.run_until_idle()
    assert p.b.get_new_notifs() == {}
    assert p.net.pending_notifs() == 3
    assert_balanced(p.net)
    assert p.net.release_held("b", reverse=reverse) == 3
    expected = [b"1", b"2", b"3"]
    assert p.b.get_new_notifs() == {"a": expected[::-1] if reverse else expected}
    p.a.send_notif("b", b"4")  # no longer held
    p.net.run_until_idle()
    assert p.b.get_new_notifs() == {"a": [b"4"]}
    assert p.net.release_held("b") == 0


# --- peer death and revival ------------------------------------------------------------------


def test_kill_with_reset() -> None:
    p = make_pair(transfer_latency=0.01)
    done = p.xfer(notif=b"")
    p.net.inject_next_post("a", "delay")
    p.a.transfer(done)
    p.net.run_until_idle()
    assert p.a.check_xfer_state(done) == "DONE"
    inflight = p.xfer(blocks=[(16, 16)], notif=b"n")
    assert p.a.transfer(inflight) == "PROC"
    p.a.send_notif("b", b"in the air")
    p.net.kill("b", reset=True)
    assert not p.b.alive
    assert p.a.check_xfer_state(inflight) == "ERR"
    assert p.a.in_flight() == 0
    with pytest.raises(RemoteDisconnectedError):
        p.a.transfer(inflight)
    with pytest.raises(RemoteDisconnectedError):
        p.a.check_xfer_state(done)
    with pytest.raises(RemoteDisconnectedError):
        p.a.send_notif("b", b"x")
    p.net.run_until_idle()
    s = p.net.stats
    assert s.xfers_err == 1 and s.notifs_dropped == 1 and s.notifs_delivered == 0
    np.testing.assert_array_equal(p.bbuf[:16], p.abuf[:16])  # the first transfer only
    assert not p.bbuf[16:].any()
    p.a.release_xfer_handle(inflight)  # cleanup still works
    p.a.remove_remote_agent("b")
    assert_balanced(p.net)


def test_dead_agent_methods_raise() -> None:
    p = make_pair()
    p.net.kill("b", reset=True)
    with pytest.raises(FabricError, match="dead"):
        p.b.get_new_notifs()
    with pytest.raises(FabricError, match="dead"):
        p.b.register_memory(np.zeros(4, dtype=np.uint8))
    with pytest.raises(FabricError, match="dead"):
        p.b.get_agent_metadata()
    assert p.b.agent_name == "b"
    assert all(v == 0 for v in p.b.open_resources().values())
    p.b.close()  # allowed, a no-op
    with pytest.raises(ValueError):
        p.net.kill("b", reset=True)


def test_kill_without_reset_is_a_black_hole() -> None:
    p = make_pair(transfer_latency=0.01)
    inflight = p.xfer(notif=b"n")
    assert p.a.transfer(inflight) == "PROC"
    p.b.send_notif("a", b"from b, in the air")
    p.a.send_notif("b", b"to b, in the air")
    p.net.kill("b", reset=False)
    p.net.run_until_idle()
    assert p.a.check_xfer_state(inflight) == "PROC"  # forever
    p.net.advance(1e6)
    assert p.a.check_xfer_state(inflight) == "PROC"
    fresh = p.xfer(notif=b"m")
    assert p.a.transfer(fresh) == "PROC"
    p.a.send_notif("b", b"into the void")  # no exception
    p.net.run_until_idle()
    assert p.a.get_new_notifs() == {}
    assert p.a.in_flight() == 2
    assert not p.bbuf.any()
    s = p.net.stats
    assert s.notifs_dropped == 3 and s.notifs_delivered == 0
    assert_balanced(p.net)


def test_killed_initiator_cancels_its_transfers() -> None:
    p = make_pair(transfer_latency=0.01)
    p.a.transfer(p.xfer(notif=b"n"))
    p.net.kill("a", reset=True)
    p.net.run_until_idle()
    assert not p.bbuf.any()
    assert p.b.get_new_notifs() == {}
    assert p.net.stats.xfers_cancelled == 1


def test_revive_after_reset() -> None:
    p = make_pair()
    old_meta = p.b.get_agent_metadata()
    old_h = p.xfer()
    p.net.kill("b", reset=True)
    b2 = p.net.revive("b")
    assert b2 is not p.b and b2.alive and b2.agent_name == "b"
    assert b2.get_agent_metadata() != old_meta
    with pytest.raises(RemoteDisconnectedError):
        p.a.transfer(old_h)  # prepared against the dead incarnation
    # The stale metadata still loads, but points at the dead process.
    assert p.a.add_remote_agent(old_meta) == "b"
    with pytest.raises(RemoteDisconnectedError):
        p.a.transfer(p.xfer())
    with pytest.raises(RemoteDisconnectedError):
        p.a.send_notif("b", b"x")
    # Fresh metadata works.
    buf = np.zeros(64, dtype=np.uint8)
    b2.register_memory(buf)
    p.a.add_remote_agent(b2.get_agent_metadata())
    b2.add_remote_agent(p.a.get_agent_metadata())
    p.bbuf = buf
    assert p.a.transfer(p.xfer(notif=b"hi")) == "DONE"
    np.testing.assert_array_equal(buf[:16], p.abuf[:16])
    p.net.run_until_idle()
    assert b2.get_new_notifs() == {"a": [b"hi"]}


def test_revive_after_silent_death_resets_the_old_connection() -> None:
    p = make_pair()
    p.net.inject_next_post("a", "delay")
    h = p.xfer()
    p.net.kill("b", reset=False)
    assert p.a.transfer(h) == "PROC"
    p.net.revive("b")
    with pytest.raises(RemoteDisconnectedError):
        p.a.check_xfer_state(h)


def test_revive_needs_a_dead_name() -> None:
    net = SimNetwork()
    net.agent("a")
    with pytest.raises(ValueError):
        net.revive("a")
    with pytest.raises(ValueError):
        net.revive("never-existed")


# --- resources -------------------------------------------------------------------------------


def test_open_resources_and_close() -> None:
    p = make_pair(transfer_latency=0.01)
    h = p.xfer()
    p.a.transfer(h)
    assert p.a.open_resources() == {
        "memory": 1,
        "dlists": 2,
        "xfers": 1,
        "remote_agents": 1,
        "in_flight": 1,
    }
    p.a.close()
    assert all(v == 0 for v in p.a.open_resources().values())
    assert p.net.stats.xfers_cancelled == 1
    with pytest.raises(FabricError, match="closed"):
        p.a.transfer(h)
    p.a.close()  # idempotent
    p.net.run_until_idle()
    assert not p.bbuf.any()
    # Peers see a disconnect; the name is free again.
    with pytest.raises(RemoteDisconnectedError):
        p.b.send_notif("a", b"x")
    assert p.net.agent("a").alive


def test_remove_remote_agent_releases_what_was_prepared_for_it() -> None:
    p = make_pair(transfer_latency=0.01)
    h = p.xfer(notif=b"n")
    p.a.transfer(h)
    p.a.prep_xfer_dlist(None, descs(p.abuf, [(0, 4)]))  # local: stays
    p.a.remove_remote_agent("b")
    assert p.a.open_resources() == {
        "memory": 1,
        "dlists": 2,
        "xfers": 0,
        "remote_agents": 0,
        "in_flight": 0,
    }
    p.net.run_until_idle()
    assert not p.bbuf.any() and p.b.get_new_notifs() == {}
    with pytest.raises(NotFoundError):
        p.a.send_notif("b", b"x")


def test_stats_is_a_snapshot() -> None:
    p = make_pair()
    before = p.net.stats
    p.a.transfer(p.xfer())
    assert before.posts == 0 and p.net.stats.posts == 1
    assert {f.name for f in fields(SimStats)} >= {"notifs_sent", "bytes_moved", "xfers_cancelled"}


# --- determinism -----------------------------------------------------------------------------


BUSY = {
    "drop_notif": 0.1,
    "duplicate_notif": 0.1,
    "delay_notif": 0.3,
    "reorder_notif": 0.2,
    "fail_post": 0.1,
    "xfer_err": 0.1,
    "xfer_stuck": 0.05,
    "transfer_latency": 1e-3,
}


def scenario(seed: int, faults: dict[str, float] = BUSY) -> tuple[object, ...]:
    """A busy run of two agents under `faults`; returns everything observable."""
    p = make_pair(seed=seed, size=256, **faults)
    states: list[str] = []
    notifs: list[dict[str, list[bytes]]] = []
    handles = [p.xfer(blocks=[(i * 16, 16)], notif=f"x{i}".encode()) for i in range(16)]
    for step in range(40):
        h = handles[step % len(handles)]
        try:
            states.append(p.a.transfer(h))
        except RepostError:
            states.append("repost")
        except FabricError:
            states.append("failed")
        p.a.send_notif("b", f"m{step}".encode())
        p.b.send_notif("a", f"r{step}".encode())
        p.net.advance(4e-4)
        for x in handles[: step % 5]:
            try:
                states.append(p.a.check_xfer_state(x))
            except FabricError:  # never posted: every post of it failed so far
                states.append("new")
        notifs.extend((p.a.get_new_notifs(), p.b.get_new_notifs()))
        assert_balanced(p.net)
        proc = [h for h in posted(p, handles) if p.a.check_xfer_state(h) == "PROC"]
        assert p.a.in_flight() == len(proc)
    p.net.run_until_idle()
    notifs.extend((p.a.get_new_notifs(), p.b.get_new_notifs()))
    assert_balanced(p.net)
    return states, notifs, p.bbuf.tobytes(), p.net.stats, p.net.now


def posted(p: Pair, handles: list[XferHandle]) -> list[XferHandle]:
    out = []
    for h in handles:
        try:
            p.a.check_xfer_state(h)
            out.append(h)
        except FabricError:
            pass
    return out


def test_same_seed_same_outcome() -> None:
    first = scenario(42)
    assert scenario(42) == first
    assert scenario(43) != first


def test_every_fault_kind_shows_up_in_the_busy_scenario() -> None:
    stats = scenario(42)[3]
    assert isinstance(stats, SimStats)
    assert stats.notifs_dropped and stats.notifs_duplicated
    assert stats.posts_failed and stats.xfers_err and stats.xfers_done


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    probs=st.lists(st.sampled_from([0.0, 0.05, 0.3, 1.0]), min_size=7, max_size=7),
    latency=st.sampled_from([0.0, 1e-4, 1e-3]),
)
def test_any_fault_mix_is_deterministic_and_balanced(
    seed: int, probs: list[float], latency: float
) -> None:
    names = ["drop_notif", "duplicate_notif", "delay_notif", "reorder_notif"]
    names += ["fail_post", "xfer_err", "xfer_stuck"]
    faults = dict(zip(names, probs, strict=True)) | {"transfer_latency": latency}
    assert scenario(seed, faults) == scenario(seed, faults)  # balance is asserted inside
