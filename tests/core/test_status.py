"""Lost completions: the side that has not heard a transfer's completion asks its peer over the
side channel before its bound (D before its watchdog in push, P before its stall bound in pull),
and only the peer's word that the transfer completed ends the request `done`. On the simulated
fabric, with the safety ledger and the models' conformance checked throughout."""

from __future__ import annotations

from kvfsm.core import ReportFailed, ReportReceived
from kvfsm.runtime import StatusQuery
from kvfsm.sim import FAST_CONFIG, Cluster
from tests.core.fixtures import Outputs, config, run, run_until, settled, state, warm

WD = FAST_CONFIG.watchdog_s
ASK = WD - FAST_CONFIG.status_query_s  # when D asks P, after its registration


def test_p_says_done_only_of_the_transfer_matched_to_the_asker() -> None:
    c = Cluster("push")
    pr = c.admit("r", 2)
    c.finish_prefill("r")
    c.settle()
    p = c.engines["P#0"]
    assert p.transfer_status(StatusQuery("P#0", "D#0", pr.d_id, pr.p_id)) == "done"
    # Another D, or another of D's ids, naming the same P request: never "done".
    assert p.transfer_status(StatusQuery("P#0", "D#9", pr.d_id, pr.p_id)) == "unknown"
    assert p.transfer_status(StatusQuery("P#0", "D#0", "other", pr.p_id)) == "unknown"
    assert p.transfer_status(StatusQuery("D#0", "D#0", pr.d_id, pr.p_id)) == "unknown"


def test_d_asks_and_a_completed_write_ends_done_instead_of_expired() -> None:
    c = Cluster("push")
    out = Outputs(c)
    c.lose_notification("D#0", "done")
    pr = c.admit("r", 3)
    c.finish_prefill("r")
    run(c, ASK - 0.05)
    assert state(c, "D#0", pr.d_id) == "writing" and not out.of("D#0", pr.d_id)
    run_until(c, lambda: out.of("D#0", pr.d_id, ReportReceived), limit=0.1)
    settled(c)
    assert c.engines["D#0"].side.counters["recovered"] == 1
    assert pr.final == {"P#0": "done", "D#0": "done"}


def test_a_p_that_never_heard_of_the_request_makes_d_fence_before_its_watchdog() -> None:
    c = Cluster("push")
    warm(c)
    out = Outputs(c)
    c.network.drop_next_notif("P#0")  # D's registration
    t0 = c.now
    pr = c.admit("r", 2)
    c.finish_prefill("r")
    run_until(c, lambda: out.of("D#0", pr.d_id, ReportFailed), limit=WD)
    [(t_fail, _)] = out.of("D#0", pr.d_id, ReportFailed)
    assert t_fail - t0 < WD  # P said "unknown": D did not wait out its watchdog
    settled(c)
    # Its registration might still have reached P: D cancelled and waited for P's word.
    assert c.engines["D#0"].side.counters["status_unknown"] == 1
    assert pr.final["D#0"] == "expired" and not out.of("D#0", pr.d_id, ReportReceived)


def test_a_write_still_under_way_renews_ds_watchdog_and_never_ends_done() -> None:
    c = Cluster("push", config=config(producer_stall_s=2 * WD))  # P's WRITE may outlast WD
    out = Outputs(c)
    c.network.inject_next_post("P#0", "stuck")  # P's WRITE hangs until P's stall bound
    pr = c.admit("r", 2)
    c.finish_prefill("r")
    run(c, WD + 0.1)
    assert state(c, "D#0", pr.d_id) == "writing"  # P said "transferring": the wait goes on
    assert c.engines["D#0"].side.counters["status_transferring"] >= 1
    settled(c)
    assert pr.final["D#0"] in ("failed", "expired") and pr.final["P#0"] == "failed"
    assert not out.of("D#0", pr.d_id, ReportReceived)


def test_p_asks_and_a_finished_read_frees_its_blocks_before_the_stall_bound() -> None:
    c = Cluster("pull")
    out = Outputs(c)
    c.lose_notification("P#0", "done")
    pr = c.admit("r", 3)
    c.finish_prefill("r")
    run_until(c, lambda: out.releases("P#0", pr.p_id), limit=FAST_CONFIG.producer_stall_s)
    [t_release] = out.releases("P#0", pr.p_id)
    assert t_release < FAST_CONFIG.producer_stall_s
    settled(c)
    assert pr.final == {"P#0": "done", "D#0": "done"}
    assert c.engines["P#0"].side.counters["recovered"] == 1


def test_with_the_side_channel_cut_no_answer_changes_anything() -> None:
    c = Cluster("push")
    warm(c)
    out = Outputs(c)
    c.lose_notification("D#0", "done")
    pr = c.admit("r", 2)
    c.finish_prefill("r")
    run_until(c, lambda: state(c, "D#0", pr.d_id) == "writing", limit=0.1)
    c.cut_side_channel("P#0")
    settled(c)
    assert pr.final["D#0"] in ("failed", "expired")
    assert not out.of("D#0", pr.d_id, ReportReceived)
    assert c.engines["D#0"].side.counters["status_unanswered"] == 1
