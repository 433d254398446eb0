"""Tests of the simulated fabric: `SimNetwork` and `SimFabric` (memory, descriptors, transfers,
notifications, the clock); faults, peer death and determinism are in test_simfabric_faults.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvfsm.fabric import (
    Fabric,
    FabricError,
    NotFoundError,
    RepostError,
    SimNetwork,
)
from tests.fabric.sim_pair import LAT, descs, idx, make_pair

# --- protocol conformance, memory and descriptors -------------------------------------------


def test_simfabric_satisfies_the_protocol() -> None:
    p = make_pair()
    assert isinstance(p.a, Fabric)
    assert p.a.agent_name == "a" and p.a.alive


def test_write_moves_real_bytes_to_the_remote() -> None:
    p = make_pair()
    h = p.xfer("WRITE", blocks=[(0, 8), (8, 8)], rblocks=[(32, 8), (0, 8)])
    assert p.a.transfer(h) == "DONE"
    assert p.a.check_xfer_state(h) == "DONE"
    np.testing.assert_array_equal(p.bbuf[32:40], p.abuf[0:8])
    np.testing.assert_array_equal(p.bbuf[0:8], p.abuf[8:16])
    assert not p.bbuf[8:32].any() and not p.bbuf[40:].any()
    assert p.net.stats.bytes_moved == 16 and p.net.stats.xfers_done == 1


def test_read_moves_real_bytes_from_the_remote() -> None:
    p = make_pair()
    p.bbuf[:] = 200
    p.bbuf[4:8] = [9, 8, 7, 6]
    h = p.xfer("READ", blocks=[(60, 4)], rblocks=[(4, 4)])
    assert p.a.transfer(h) == "DONE"
    assert list(p.abuf[60:64]) == [9, 8, 7, 6]
    assert list(p.abuf[:4]) == [1, 2, 3, 4]  # nothing else touched


def test_index_arrays_pair_rows_in_any_order() -> None:
    p = make_pair()
    ld = p.a.prep_xfer_dlist(None, descs(p.abuf, [(0, 4), (4, 4), (8, 4)]))
    rd = p.a.prep_xfer_dlist("b", descs(p.bbuf, [(0, 4), (4, 4), (8, 4)]))
    h = p.a.make_prepped_xfer("WRITE", ld, idx(2, 0), rd, idx(0, 2), b"")
    assert p.a.transfer(h) == "DONE"
    np.testing.assert_array_equal(p.bbuf[0:4], p.abuf[8:12])
    np.testing.assert_array_equal(p.bbuf[8:12], p.abuf[0:4])
    assert not p.bbuf[4:8].any()


def test_loopback_transfer_within_one_agent() -> None:
    net = SimNetwork()
    a = net.agent("a")
    buf = np.arange(32, dtype=np.uint8)
    a.register_memory(buf)
    a.add_remote_agent(a.get_agent_metadata())
    ld = a.prep_xfer_dlist(None, descs(buf, [(0, 8)]))
    rd = a.prep_xfer_dlist("a", descs(buf, [(16, 8)]))
    h = a.make_prepped_xfer("WRITE", ld, idx(0), rd, idx(0), b"self")
    assert a.transfer(h) == "DONE"
    assert list(buf[16:24]) == list(range(8))
    net.run_until_idle()
    assert a.get_new_notifs() == {"a": [b"self"]}


@pytest.mark.parametrize(
    ("buffer", "error"),
    [
        ([1, 2, 3], TypeError),
        (np.zeros(8, dtype=np.float32), TypeError),
        (np.zeros((2, 4), dtype=np.uint8), ValueError),
        (np.zeros(16, dtype=np.uint8)[::2], ValueError),
        (np.zeros(0, dtype=np.uint8), ValueError),
    ],
)
def test_register_memory_rejects_bad_buffers(buffer: Any, error: type[Exception]) -> None:
    a = SimNetwork().agent("a")
    with pytest.raises(error):
        a.register_memory(buffer)
    assert a.open_resources()["memory"] == 0


def test_register_memory_rejects_read_only_buffers() -> None:
    buf = np.zeros(8, dtype=np.uint8)
    buf.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        SimNetwork().agent("a").register_memory(buf)


def test_local_rows_out_of_bounds_are_rejected_naming_the_row() -> None:
    p = make_pair(size=64)
    with pytest.raises(FabricError, match="row 1"):
        p.a.prep_xfer_dlist(None, descs(p.abuf, [(0, 8), (60, 8)]))
    with pytest.raises(FabricError, match="row 0"):
        p.a.prep_xfer_dlist(None, descs(p.abuf, [(-1, 8)]))
    with pytest.raises(FabricError, match="row 0"):
        p.a.prep_xfer_dlist(None, descs(p.abuf, [(0, -1)]))
    with pytest.raises(FabricError, match="row 0"):
        p.a.prep_xfer_dlist(None, descs(p.abuf, [(0, 8)], dev=1))
    with pytest.raises(FabricError, match="row 0"):  # another agent's memory is not ours
        p.a.prep_xfer_dlist(None, descs(p.bbuf, [(0, 8)]))
    assert p.a.open_resources()["dlists"] == 0


def test_a_row_spanning_two_adjacent_regions_is_rejected() -> None:
    a = SimNetwork().agent("a")
    big = np.zeros(64, dtype=np.uint8)
    a.register_memory(big[:32])
    a.register_memory(big[32:])
    a.prep_xfer_dlist(None, descs(big, [(0, 32), (32, 32)]))
    with pytest.raises(FabricError, match="row 0"):
        a.prep_xfer_dlist(None, descs(big, [(16, 32)]))


def test_remote_rows_out_of_bounds_are_rejected() -> None:
    p = make_pair(size=64)
    with pytest.raises(FabricError, match="row 2"):
        p.a.prep_xfer_dlist("b", descs(p.bbuf, [(0, 8), (8, 8), (56, 9)]))
    with pytest.raises(FabricError, match="row 0"):
        p.a.prep_xfer_dlist("b", descs(p.abuf, [(0, 8)]))  # a's memory is not b's


def test_malformed_descriptor_arrays_are_rejected() -> None:
    p = make_pair()
    good = descs(p.abuf, [(0, 8)])
    bads: list[Any] = [good.astype(np.int32), good.reshape(-1), good[:, :2], [[1, 2, 0]]]
    for bad in bads:
        with pytest.raises(FabricError):
            p.a.prep_xfer_dlist(None, bad)


def test_empty_descriptor_list_is_allowed() -> None:
    p = make_pair()
    h = p.a.prep_xfer_dlist(None, np.zeros((0, 3), dtype=np.int64))
    p.a.release_dlist_handle(h)


def test_remote_dlist_needs_a_loaded_agent() -> None:
    p = make_pair()
    with pytest.raises(NotFoundError):
        p.a.prep_xfer_dlist("nobody", descs(p.bbuf, [(0, 8)]))


def test_metadata_is_a_snapshot_of_registered_memory() -> None:
    # As in NIXL: memory registered after the metadata was exported is unknown to peers.
    p = make_pair()
    extra = np.zeros(16, dtype=np.uint8)
    p.b.register_memory(extra)
    with pytest.raises(FabricError, match="row 0"):
        p.a.prep_xfer_dlist("b", descs(extra, [(0, 16)]))
    assert p.a.add_remote_agent(p.b.get_agent_metadata()) == "b"
    p.a.prep_xfer_dlist("b", descs(extra, [(0, 16)]))


def test_metadata_round_trip_and_malformed_metadata() -> None:
    p = make_pair()
    meta = p.b.get_agent_metadata()
    assert isinstance(meta, bytes)
    assert p.a.add_remote_agent(meta) == "b"  # reloading is allowed
    for bad in (b"", b"garbage", b"{}", b'{"kind": 1}', meta[:-3]):
        with pytest.raises(FabricError):
            p.a.add_remote_agent(bad)
    other = SimNetwork().agent("b")
    with pytest.raises(FabricError, match="not from this SimNetwork"):
        p.a.add_remote_agent(other.get_agent_metadata())


def test_make_prepped_xfer_validates_its_arguments() -> None:
    p = make_pair()
    ld = p.a.prep_xfer_dlist(None, descs(p.abuf, [(0, 8), (8, 4)]))
    rd = p.a.prep_xfer_dlist("b", descs(p.bbuf, [(0, 8), (8, 8)]))
    with pytest.raises(FabricError, match="pair 0"):
        p.a.make_prepped_xfer("WRITE", ld, idx(1), rd, idx(1), b"")
    with pytest.raises(FabricError, match="rows"):
        p.a.make_prepped_xfer("WRITE", ld, idx(0, 1), rd, idx(0), b"")
    with pytest.raises(FabricError, match="out of range"):
        p.a.make_prepped_xfer("WRITE", ld, idx(2), rd, idx(0), b"")
    with pytest.raises(FabricError, match="out of range"):
        p.a.make_prepped_xfer("WRITE", ld, idx(-1), rd, idx(0), b"")
    with pytest.raises(FabricError, match="local dlist and a remote"):
        p.a.make_prepped_xfer("WRITE", rd, idx(0), ld, idx(0), b"")
    with pytest.raises(FabricError, match="op"):
        p.a.make_prepped_xfer("COPY", ld, idx(0), rd, idx(0), b"")  # type: ignore[arg-type]
    with pytest.raises(NotFoundError):
        p.a.make_prepped_xfer("WRITE", 999_999, idx(0), rd, idx(0), b"")
    with pytest.raises(FabricError, match="integer"):
        p.a.make_prepped_xfer("WRITE", ld, np.array([0.0]), rd, idx(0), b"")
    assert p.a.open_resources()["xfers"] == 0


def test_make_xfer_moves_rows_given_directly_without_merging_them() -> None:
    p = make_pair()
    local, remote = descs(p.abuf, [(0, 8), (8, 8)]), descs(p.bbuf, [(16, 8), (24, 8)])
    h = p.a.make_xfer("WRITE", local, "b", remote, b"")
    assert p.a.transfer(h) == "DONE"
    np.testing.assert_array_equal(p.bbuf[16:32], p.abuf[0:16])
    assert not p.bbuf[:16].any() and not p.bbuf[32:].any()
    telemetry = p.a.xfer_telemetry(h)
    assert telemetry is not None and telemetry.descriptors == 2  # adjacent, yet not merged
    with pytest.raises(FabricError, match="pair 1"):
        p.a.make_xfer("WRITE", local, "b", descs(p.bbuf, [(0, 8), (8, 4)]), b"")
    with pytest.raises(FabricError, match="not inside memory registered by 'b'"):
        p.a.make_xfer("WRITE", local, "b", descs(p.bbuf, [(0, 8), (60, 8)]), b"")
    with pytest.raises(FabricError, match="2 local rows cannot pair with 1"):
        p.a.make_xfer("WRITE", local, "b", descs(p.bbuf, [(0, 8)]), b"")
    with pytest.raises(NotFoundError, match="not loaded"):
        p.a.make_xfer("READ", local, "nobody", remote, b"")
    with pytest.raises(FabricError, match="op"):
        p.a.make_xfer("COPY", local, "b", remote, b"")  # type: ignore[arg-type]


def test_zero_row_transfer_completes_and_still_notifies() -> None:
    p = make_pair()
    ld = p.a.prep_xfer_dlist(None, descs(p.abuf, [(0, 8)]))
    rd = p.a.prep_xfer_dlist("b", descs(p.bbuf, [(0, 8)]))
    h = p.a.make_prepped_xfer("WRITE", ld, idx(), rd, idx(), b"empty")
    assert p.a.transfer(h) == "DONE"
    assert not p.bbuf.any()
    p.net.advance(LAT)
    assert p.b.get_new_notifs() == {"a": [b"empty"]}


# --- transfer lifecycle ----------------------------------------------------------------------


def test_notification_arrives_strictly_after_done() -> None:
    p = make_pair()
    h = p.xfer(notif=b"kv-ready")
    assert p.a.transfer(h) == "DONE"
    assert p.b.get_new_notifs() == {}  # never inside transfer()
    p.net.advance_to(LAT / 2)
    assert p.b.get_new_notifs() == {}
    p.net.advance_to(LAT)
    assert p.b.get_new_notifs() == {"a": [b"kv-ready"]}
    assert p.b.get_new_notifs() == {}  # drained


def test_empty_notif_means_no_notification() -> None:
    p = make_pair()
    assert p.a.transfer(p.xfer(notif=b"")) == "DONE"
    p.net.run_until_idle()
    assert p.b.get_new_notifs() == {}
    assert p.net.stats.notifs_sent == 0


def test_transfer_latency_completes_when_the_clock_gets_there() -> None:
    p = make_pair(transfer_latency=0.01)
    h = p.xfer(notif=b"n")
    assert p.a.transfer(h) == "PROC"
    assert p.a.in_flight() == 1
    assert not p.bbuf.any()  # nothing copied yet
    p.net.advance_to(0.005)
    assert p.a.check_xfer_state(h) == "PROC"
    p.net.advance_to(0.01)
    assert p.a.check_xfer_state(h) == "DONE"
    np.testing.assert_array_equal(p.bbuf[:16], p.abuf[:16])
    assert p.b.get_new_notifs() == {}  # the notification comes strictly later
    p.net.advance_to(0.01 + LAT)
    assert p.b.get_new_notifs() == {"a": [b"n"]}
    assert p.a.in_flight() == 0


def test_repost_while_in_progress_raises_and_repost_after_done_copies_again() -> None:
    p = make_pair(transfer_latency=0.01)
    h = p.xfer(notif=b"n")
    assert p.a.transfer(h) == "PROC"
    with pytest.raises(RepostError):
        p.a.transfer(h)
    p.net.advance(0.01)
    assert p.a.check_xfer_state(h) == "DONE"
    p.abuf[:16] = 77
    assert p.a.transfer(h) == "PROC"
    p.net.run_until_idle()
    assert p.a.check_xfer_state(h) == "DONE"
    assert (p.bbuf[:16] == 77).all()
    assert p.b.get_new_notifs() == {"a": [b"n", b"n"]}
    assert p.net.stats.posts == 2  # the refused repost is not a post


def test_release_in_progress_cancels_bytes_and_notification() -> None:
    p = make_pair(transfer_latency=0.01)
    h = p.xfer(notif=b"n")
    assert p.a.transfer(h) == "PROC"
    p.a.release_xfer_handle(h)
    assert p.a.in_flight() == 0
    p.net.run_until_idle()
    assert not p.bbuf.any()
    assert p.b.get_new_notifs() == {}
    assert p.net.stats.xfers_cancelled == 1 and p.net.stats.xfers_done == 0
    with pytest.raises(NotFoundError):
        p.a.check_xfer_state(h)  # it never completed


def test_released_done_handle_still_answers_done() -> None:
    p = make_pair()
    h = p.xfer()
    assert p.a.transfer(h) == "DONE"
    p.a.release_xfer_handle(h)
    assert p.a.check_xfer_state(h) == "DONE"  # the NIXL quirk
    with pytest.raises(NotFoundError):
        p.a.transfer(h)
    with pytest.raises(NotFoundError):
        p.a.release_xfer_handle(h)
    assert p.a.open_resources()["xfers"] == 0


def test_unknown_and_foreign_handles_are_not_found() -> None:
    p = make_pair()
    h = p.xfer()
    for call in (p.a.transfer, p.a.check_xfer_state, p.a.release_xfer_handle):
        with pytest.raises(NotFoundError):
            call(123_456)
    for call in (p.b.transfer, p.b.check_xfer_state, p.b.release_xfer_handle):
        with pytest.raises(NotFoundError):
            call(h)  # a's handle means nothing to b
    with pytest.raises(NotFoundError):
        p.a.release_dlist_handle(123_456)
    with pytest.raises(NotFoundError):
        p.a.deregister_memory(123_456)
    with pytest.raises(NotFoundError):
        p.a.remove_remote_agent("nobody")


def test_checking_a_never_posted_handle_is_an_error() -> None:
    p = make_pair()
    h = p.xfer()
    with pytest.raises(FabricError, match="never posted"):
        p.a.check_xfer_state(h)


def test_deregistered_memory_makes_the_transfer_fail() -> None:
    p = make_pair(transfer_latency=0.01)
    extra = np.ones(8, dtype=np.uint8)
    mh = p.a.register_memory(extra)
    ld = p.a.prep_xfer_dlist(None, descs(extra, [(0, 8)]))
    rd = p.a.prep_xfer_dlist("b", descs(p.bbuf, [(0, 8)]))
    h = p.a.make_prepped_xfer("WRITE", ld, idx(0), rd, idx(0), b"n")
    assert p.a.transfer(h) == "PROC"
    p.a.deregister_memory(mh)
    p.net.run_until_idle()
    assert p.a.check_xfer_state(h) == "ERR"
    assert not p.bbuf.any()
    assert p.b.get_new_notifs() == {}


def test_released_dlists_leave_made_transfers_usable() -> None:
    p = make_pair()
    ld = p.a.prep_xfer_dlist(None, descs(p.abuf, [(0, 8)]))
    rd = p.a.prep_xfer_dlist("b", descs(p.bbuf, [(0, 8)]))
    h = p.a.make_prepped_xfer("WRITE", ld, idx(0), rd, idx(0), b"")
    p.a.release_dlist_handle(ld)
    p.a.release_dlist_handle(rd)
    assert p.a.transfer(h) == "DONE"
    np.testing.assert_array_equal(p.bbuf[:8], p.abuf[:8])


# --- notifications ---------------------------------------------------------------------------


def test_send_notif_delivers_by_sender_in_arrival_order() -> None:
    net = SimNetwork()
    a, b, c = net.agent("a"), net.agent("b"), net.agent("c")
    for s in (a, c):
        s.add_remote_agent(b.get_agent_metadata())
    a.send_notif("b", b"a1")
    c.send_notif("b", b"c1")
    a.send_notif("b", b"a2")
    assert b.get_new_notifs() == {}
    net.advance(LAT)
    got = b.get_new_notifs()
    assert got == {"a": [b"a1", b"a2"], "c": [b"c1"]}
    assert list(got) == ["a", "c"]
    assert net.stats.notifs_sent == 3 and net.stats.notifs_delivered == 3


def test_send_notif_needs_a_loaded_agent_and_bytes() -> None:
    p = make_pair()
    with pytest.raises(NotFoundError):
        p.a.send_notif("nobody", b"x")
    with pytest.raises(FabricError):
        p.a.send_notif("b", "text")  # type: ignore[arg-type]


# --- the clock -------------------------------------------------------------------------------


def test_clock_only_moves_forward() -> None:
    net = SimNetwork()
    assert net.now == 0.0
    net.advance_to(1.5)
    net.advance(0.5)
    assert net.now == 2.0
    with pytest.raises(ValueError):
        net.advance_to(1.0)
    with pytest.raises(ValueError):
        net.advance_to(float("nan"))
    net.advance_to(2.0)  # staying put is fine


def test_next_event_time_and_run_until_idle() -> None:
    p = make_pair(transfer_latency=0.25)
    assert p.net.next_event_time() is None
    p.a.transfer(p.xfer(notif=b"n"))
    assert p.net.next_event_time() == 0.25
    assert p.net.run_until_idle() == pytest.approx(0.25 + LAT)
    assert p.net.next_event_time() is None
    assert p.b.get_new_notifs() == {"a": [b"n"]}


def test_duplicate_live_agent_name_is_rejected() -> None:
    net = SimNetwork()
    net.agent("a")
    with pytest.raises(ValueError, match="already exists"):
        net.agent("a")
    with pytest.raises(ValueError):
        net.agent("")
