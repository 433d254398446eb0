"""Directed tests of the sans-I/O core under faults: aborts from every state, requests with several
transfer handles, completion counting across TP ranks, duplicate/late/unknown/malformed messages,
and the library bugs found while writing them (each fixed, each with its test).

The helpers are test_core.py's.
"""

from __future__ import annotations

import pytest

from kvfsm.core import (
    Admit,
    Identity,
    Mode,
    NotificationReceived,
    Producer,
    ReportFailed,
    ReportReceived,
)
from kvfsm.sim import FAST_CONFIG, Cluster
from kvfsm.testing import drive_to, live_states
from kvfsm.wire import (
    MAX_MESSAGE_BYTES,
    Cancel,
    CancelAck,
    Completion,
    Failure,
    Grant,
    Heartbeat,
    Message,
    Progress,
    Registration,
    encode,
    pack_blocks,
)
from tests.core.fixtures import (
    MODES,
    Outputs,
    admit_d_only,
    admit_p,
    blocks,
    registration,
    run,
    run_until,
    settled,
    state,
    warm,
)

BLOCK_BYTES = 512  # a block of Cluster's model, all heads (TP ranks hold slices)

# --- 4. abort from every state ---------------------------------------------------------------------

P_STATES = {
    "push": ["allocated", "registered", "leased", "matched", "writing", "draining"],
    "pull": ["allocated", "registered", "leased", "matched", "reading", "draining"],
}
D_STATES = {
    "push": ["allocated", "registered", "writing", "fencing", "releasing"],
    "pull": ["allocated", "registered", "reading", "draining", "releasing"],
}
ABORTS = [
    (mode, side, s)
    for mode in MODES
    for side, table in (("P", P_STATES), ("D", D_STATES))
    for s in table[mode]
]


def test_the_abort_cases_cover_every_live_state_of_every_request_model() -> None:
    for mode in MODES:
        for side, table in (("P", P_STATES), ("D", D_STATES)):
            assert table[mode] == live_states(mode, side), (side, mode)


@pytest.mark.parametrize(("mode", "side", "target"), ABORTS)
def test_abort_from_every_state_releases_once_and_engines_keep_serving(
    mode: Mode, side: str, target: str
) -> None:
    cluster = Cluster(mode)
    out = Outputs(cluster)
    pr = drive_to(cluster, side, target)
    agent, rid = f"{side}#0", pr.p_id if side == "P" else pr.d_id
    assert state(cluster, agent, rid) == target
    cluster.abort("r", side)
    cluster.finish_prefill("r")  # the serving engine's part, if not done yet
    cluster.settle()
    cluster.step(60.0)  # a hung handshake answers at last
    settled(cluster)
    [(_, fin)] = out.finished(agent, rid)
    assert fin.state == ("done" if target == "releasing" else "aborted")
    assert len(out.releases(agent, rid)) == 1
    nxt = cluster.admit("next", 4)
    cluster.finish_prefill("next")
    settled(cluster)
    assert nxt.final == {"P#0": "done", "D#0": "done"}


# --- 5. several handles: nothing is released before every handle ended ---------------------------


def tally(cluster: Cluster, agent: str, rid: str) -> tuple[int, int, str]:
    t = cluster.engines[agent].side.requests[rid].tally
    return t.ok, t.failed, t.state


@pytest.mark.parametrize(
    ("mode", "p_tp", "d_tp"), [("push", 1, 2), ("pull", 2, 1)], ids=["push_1x2", "pull_2x1"]
)
def test_failed_handle_waits_for_its_sibling(mode: Mode, p_tp: int, d_tp: int) -> None:
    cluster = Cluster(mode, p_tp=p_tp, d_tp=d_tp)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    run(cluster, 0.05)
    poster, rid = ("P#0", pr.p_id) if mode == "push" else ("D#0", pr.d_id)
    cluster.network.inject_next_post(poster, "err")  # the first handle fails at once ...
    cluster.network.inject_next_post(poster, "delay")  # ... its sibling lands 1 ms later
    cluster.finish_prefill("r")
    run_until(cluster, lambda: tally(cluster, poster, rid)[1] == 1, limit=0.01, dt=1e-4)
    t_err = cluster.network.now
    steps = 0
    while not out.finished(poster, rid):
        assert tally(cluster, poster, rid) == (0, 1, "failing")
        assert state(cluster, poster, rid) in ("writing", "reading")
        assert out.of(poster, rid) == []  # no failure reported, no block released
        assert cluster.engines[poster].inflight  # the sibling is still in flight
        cluster.step(1e-4)
        steps += 1
    assert steps >= 5
    [(t_end, fin)] = out.finished(poster, rid)
    assert fin.state == "failed" and fin.history[-1][0] == "transfer_failed"
    assert t_end >= t_err + 1e-3 - 1e-9
    assert len(out.releases(poster, rid)) == 1
    if mode == "pull":
        assert len(out.of(poster, rid, ReportFailed)) == 1
    settled(cluster)
    receivers = cluster.agents("D" if mode == "push" else "P")
    assert sorted(pr.final[a] for a in receivers) == ["done", "failed"]


# --- 6. completion counting ----------------------------------------------------------------------


def test_pull_p_is_done_only_after_every_d_rank_read() -> None:
    cluster = Cluster("pull", d_tp=2)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    run_until(cluster, lambda: len(cluster.engines["P#0"].side.requests[pr.p_id].links) == 2)
    cluster.network.inject_next_post("D#1", "delay")  # D#1's READ lands a little later
    cluster.finish_prefill("r")
    run_until(cluster, lambda: tally(cluster, "P#0", pr.p_id)[0] == 1, limit=0.01, dt=1e-4)
    assert pr.final == {"D#0": "done"}
    assert state(cluster, "P#0", pr.p_id) == "reading" and out.releases("P#0", pr.p_id) == []
    settled(cluster)
    assert pr.final == {"D#0": "done", "D#1": "done", "P#0": "done"}
    assert len(out.releases("P#0", pr.p_id)) == 1
    assert cluster.ledger.verified_bytes == 4 * BLOCK_BYTES  # two D ranks, half the heads each


def test_push_d_is_done_only_after_every_p_rank_wrote() -> None:
    cluster = Cluster("push", p_tp=2)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    run_until(cluster, lambda: state(cluster, "P#1", pr.p_id) == "registered")
    cluster.network.inject_next_post("P#1", "delay")  # P#1's WRITE lands a little later
    cluster.finish_prefill("r")
    run_until(cluster, lambda: tally(cluster, "D#0", pr.d_id)[0] == 1, limit=0.01, dt=1e-4)
    assert state(cluster, "D#0", pr.d_id) == "writing" and out.of("D#0", pr.d_id) == []
    settled(cluster)
    assert pr.final == {"P#0": "done", "P#1": "done", "D#0": "done"}
    assert len(out.of("D#0", pr.d_id, ReportReceived)) == 1


# --- 9. duplicate, late, unknown and malformed notifications ---------------------------------------


@pytest.mark.parametrize(
    ("mode", "p_tp", "d_tp", "counted"),
    [
        ("push", 1, 1, "late"),  # the one completion ended the request: its copy comes after
        ("pull", 1, 1, "late"),
        ("push", 2, 1, "duplicate"),  # D still waits for P#1's completion
        ("pull", 1, 2, "duplicate"),  # P still waits for D#1's completion
    ],
)
def test_duplicated_completion_is_counted_and_changes_nothing(
    mode: Mode, p_tp: int, d_tp: int, counted: str
) -> None:
    cluster = Cluster(mode, p_tp=p_tp, d_tp=d_tp)
    net = cluster.network
    pr = cluster.admit("r", 4)
    run(cluster, 0.05)
    if p_tp == 2:
        net.inject_next_post("P#1", "delay")
    if d_tp == 2:
        net.inject_next_post("D#1", "delay")
    if mode == "push":  # to D#0: P#0's Progress, then the completion of its WRITE
        receiver = "D#0"
        net.delay_next_notif(receiver, 0.0)
        net.duplicate_next_notif(receiver)
        cluster.finish_prefill("r")
    else:  # to P#0: once P granted the read, the completion of D#0's READ comes first
        receiver = "P#0"
        cluster.finish_prefill("r")
        run_until(cluster, lambda: state(cluster, "P#0", pr.p_id) == "reading", dt=1e-4)
        net.duplicate_next_notif(receiver)
    settled(cluster)
    assert net.stats.notifs_duplicated == 1
    counters = cluster.engines[receiver].side.counters
    assert counters[counted] == 1
    assert counters["duplicate" if counted == "late" else "late"] == 0
    assert set(pr.final.values()) == {"done"} and len(pr.final) == p_tp + d_tp
    assert cluster.ledger.verified_bytes == 4 * BLOCK_BYTES  # D's ranks split the heads


def messages_to(side: str, mode: Mode, rid: str, sender_rid: str) -> list[Message]:
    """Every message a side takes about one request."""
    if side == "P":
        return [Completion(rid, sender_rid, 0, 1)]
    return [
        Progress(rid, sender_rid, 0, 1),
        Completion(rid, sender_rid, 0, 1),
        Failure(rid, sender_rid, 0, 1, "gone"),
        CancelAck(rid, sender_rid, 0, 1),
        Grant(rid, sender_rid, 0, 1, pack_blocks([1, 2]), 1e9),
    ]


def deliver(cluster: Cluster, receiver: str, sender: str, message: Message | bytes) -> None:
    payload = message if isinstance(message, bytes) else encode(message)
    cluster.engines[receiver].submit(NotificationReceived(sender, payload))
    cluster.collect()


@pytest.mark.parametrize("mode", MODES)
def test_notifications_for_ended_requests_are_counted_late(mode: Mode) -> None:
    cluster = Cluster(mode)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    settled(cluster)
    logged = len(out.log)
    for message in messages_to("D", mode, pr.d_id, pr.p_id):
        deliver(cluster, "D#0", "P#0", message)
    assert cluster.engines["D#0"].side.counters["late"] == 5
    late = [
        *messages_to("P", mode, pr.p_id, pr.d_id),
        Registration(pr.p_id, pr.d_id, 0, 1, "D", b"", 1e9),
    ]
    for message in late:
        deliver(cluster, "P#0", "D#0", message)
    assert cluster.engines["P#0"].side.counters["late"] == 2
    assert len(out.log) == logged and cluster.ledger.quiescence() == []


@pytest.mark.parametrize("mode", MODES)
def test_notifications_for_unknown_requests_are_counted_unknown(mode: Mode) -> None:
    cluster = Cluster(mode)
    warm(cluster)
    for message in messages_to("D", mode, "ghost-00000000", "ghost-11111111"):
        deliver(cluster, "D#0", "P#0", message)
    assert cluster.engines["D#0"].side.counters["unknown"] == 5
    for message in [
        *messages_to("P", mode, "ghost-11111111", "ghost-00000000"),
        Cancel("ghost-11111111", "ghost-00000000", 0, 1),
    ]:
        deliver(cluster, "P#0", "D#0", message)
    assert cluster.engines["P#0"].side.counters["unknown"] == 2
    before = cluster.engines["P#0"].side.counters["heartbeat_unknown"]
    deliver(cluster, "P#0", "D#0", Heartbeat(["ghost-00000000"], 0))
    assert cluster.engines["P#0"].side.counters["heartbeat_unknown"] == before + 1
    settled(cluster)


GARBAGE = [
    b"",
    b"garbage",
    b"kv1",
    b"kv1\x81\xa1k\xa4done",  # the tag of a completion, no fields
    b"kv1\x00" * 10,
    encode(Completion("r", "r", -1, 1)),  # impossible rank
    encode(Registration("r", "r", 0, 1, "D", b"\x01\x02\x03", 1.0)),  # not whole int32s
    b"kv1" + b"\x00" * MAX_MESSAGE_BYTES,  # too large
]


@pytest.mark.parametrize("mode", MODES)
def test_malformed_notifications_are_counted_and_engines_keep_serving(mode: Mode) -> None:
    cluster = Cluster(mode)
    for agent in ("P#0", "D#0"):
        for payload in GARBAGE:
            cluster.inject_garbage(agent, payload)
        assert cluster.engines[agent].side.counters["malformed"] == len(GARBAGE)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    settled(cluster)
    assert pr.final == {"P#0": "done", "D#0": "done"}


# --- library bugs and questionable behaviour found (each test states the behaviour wanted) ----------


def test_cancel_withdraws_a_pending_registration() -> None:
    cluster = Cluster("push")
    warm(cluster)  # connected: P's acknowledgement reaches D
    pr = admit_d_only(cluster, "r", 4)
    run(cluster, 0.05)
    cluster.abort("r", "D")
    run(cluster, 0.05)
    assert pr.final == {"D#0": "aborted"}  # acknowledged: D's blocks went back to its allocator
    posted = cluster.engines["P#0"].counters["posted"]
    admit_p(cluster, pr)
    cluster.finish_prefill("r")
    run(cluster, 0.05)
    assert cluster.engines["P#0"].counters["posted"] == posted, "P wrote into freed D blocks"


@pytest.mark.parametrize("mode", MODES)
def test_duplicated_registration_is_counted_not_kept(mode: Mode) -> None:
    cluster = Cluster(mode)
    pr = cluster.admit("r", 4)
    cluster.network.duplicate_next_notif("P#0")  # D's registration arrives twice
    run(cluster, 0.05)
    cluster.finish_prefill("r")
    settled(cluster)
    assert pr.final == {"P#0": "done", "D#0": "done"}
    p = cluster.engines["P#0"].side
    run(cluster, FAST_CONFIG.pending_registration_ttl_s)
    assert (p.counters["duplicate"], p.counters["registration_expired"]) == (1, 0)


@pytest.mark.parametrize("mode", MODES)
def test_every_d_rank_registered_before_admission_is_matched_by_exact_id(mode: Mode) -> None:
    p = Producer(Identity("P"), mode, FAST_CONFIG)
    for rank in range(2):  # D (TP 2) knows P's id; its own id shares no base with it
        p.handle(NotificationReceived(f"D#{rank}", registration("p-1", "d-1", rank=rank, tp=2)), 0)
    p.handle(Admit("p-1", blocks(5, 6)), 0.1)
    assert sorted(p.requests["p-1"].links) == ["D#0", "D#1"]


@pytest.mark.parametrize("mode", MODES)
def test_pending_registration_goes_to_the_request_it_names(mode: Mode) -> None:
    p = Producer(Identity("P"), mode, FAST_CONFIG)
    p.handle(NotificationReceived("D#0", registration("r-bbbbbbbb", "r-cccccccc")), 0.0)
    p.handle(Admit("r-aaaaaaaa", blocks(1)), 0.1)
    p.handle(Admit("r-bbbbbbbb", blocks(2)), 0.1)
    assert not p.requests["r-aaaaaaaa"].links
    assert list(p.requests["r-bbbbbbbb"].links) == ["D#0"]


@pytest.mark.parametrize("mode", MODES)
def test_cancel_for_an_ended_request_is_counted_late(mode: Mode) -> None:
    cluster = Cluster(mode)
    pr = cluster.admit("r", 4)
    cluster.finish_prefill("r")
    settled(cluster)
    deliver(cluster, "P#0", "D#0", Cancel(pr.p_id, pr.d_id, 0, 1))
    assert cluster.engines["P#0"].side.counters["late"] == 1


def test_push_p_acknowledges_cancel_of_a_request_it_never_matched() -> None:
    cluster = Cluster("push")
    warm(cluster)  # connected: an acknowledgement would reach D
    out = Outputs(cluster)
    cluster.network.drop_next_notif("P#0")  # D's registration
    pr = cluster.admit("r", 4)
    run(cluster, 0.5)
    cluster.finish_prefill("r")  # P leased until after D's watchdog
    run_until(cluster, lambda: out.of("D#0", pr.d_id, ReportFailed), FAST_CONFIG.watchdog_s)
    run(cluster, 0.1)
    assert pr.final["P#0"] == "done"  # P took the cancel and released its blocks
    assert out.releases("D#0", pr.d_id), "D still fences blocks nothing can write"


@pytest.mark.parametrize("mode", MODES)
def test_p_tells_d_of_a_failure_before_it_connected(mode: Mode) -> None:
    cluster = Cluster(mode)
    pr = cluster.admit("r", 4)
    run_until(cluster, lambda: state(cluster, "P#0", pr.p_id) == "registered")
    cluster.finish_prefill("r", without_blocks=True)
    run(cluster, 0.1)
    assert pr.final.get("D#0") == "failed"
