"""Directed tests of the sans-I/O core (`Producer`, `Consumer`): matching, leases, the watchdog and
fence, prefix-cache hits, requests without blocks and protocol errors.

Most run on a `Cluster` (both engines on the simulated fabric, the safety ledger watching); the
ones about indexes and deadlines drive a core directly. Time is simulated throughout.
Aborts, several handles, completion counting, duplicate/late/unknown messages and the library
bugs found are in test_core_faults.py; the helpers they share are in fixtures.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvfsm.core import (
    Admit,
    Consumer,
    Finished,
    HandshakeDone,
    Identity,
    Mode,
    NotificationReceived,
    PrefillFinished,
    Producer,
    ReleaseBlocks,
    ReportFailed,
    ReportReceived,
    SendNotification,
    StartHandshake,
    Tick,
)
from kvfsm.lifecycle import LocalProtocolError
from kvfsm.sim import FAST_CONFIG, Cluster
from kvfsm.wire import Grant, Heartbeat, Progress, Registration, decode, encode, pack_blocks
from tests.core.fixtures import (
    BLOCK_BYTES,
    MODES,
    Outputs,
    admit_d_only,
    admit_p,
    blocks,
    config,
    registration,
    run,
    run_until,
    settled,
    state,
    warm,
)

# --- 1. matching ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d_first", [False, True], ids=["p_first", "d_first"])
@pytest.mark.parametrize("same_id", [True, False], ids=["exact_id", "base_id"])
def test_registration_matches_by_exact_and_base_id(
    mode: Mode, d_first: bool, same_id: bool
) -> None:
    cluster = Cluster(mode)
    pr = cluster.admit("r", 4, d_first=d_first, same_id=same_id)
    assert (pr.p_id == pr.d_id) == same_id
    run_until(cluster, lambda: state(cluster, "P#0", pr.p_id) == "registered")
    link = cluster.engines["P#0"].side.requests[pr.p_id].links["D#0"]
    assert link.request_id == pr.d_id
    assert list(link.block_ids) == list(pr.d_blocks)
    cluster.finish_prefill("r")
    settled(cluster)
    assert pr.final == {"P#0": "done", "D#0": "done"}
    assert cluster.ledger.verified_bytes == 4 * BLOCK_BYTES


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("same_id", [True, False], ids=["exact_id", "base_id"])
def test_registration_before_p_admits_is_kept_and_matched(mode: Mode, same_id: bool) -> None:
    cluster = Cluster(mode)
    pr = admit_d_only(cluster, "r", 4, same_id=same_id)
    p = cluster.engines["P#0"].side
    run_until(cluster, lambda: state(cluster, "D#0", pr.d_id) == "registered")
    run(cluster, 0.05)
    assert p.requests == {} and p.counters["registration_expired"] == 0
    admit_p(cluster, pr)
    assert state(cluster, "P#0", pr.p_id) == "registered"  # matched at admission
    cluster.finish_prefill("r")
    settled(cluster)
    assert pr.final == {"P#0": "done", "D#0": "done"}
    assert cluster.ledger.verified_bytes == 4 * BLOCK_BYTES


@pytest.mark.parametrize("mode", MODES)
def test_exact_id_wins_over_base_id(mode: Mode) -> None:
    p = Producer(Identity("P"), mode, FAST_CONFIG)
    for rid in ("r-aaaaaaaa", "r-bbbbbbbb", "s-eeeeeeee"):
        p.handle(Admit(rid, blocks(1, 2)), 0.0)

    def matched() -> dict[str, list[str]]:
        return {rid: list(req.links) for rid, req in p.requests.items() if req.links}

    # P's id as D knows it, although the base id would pick the first "r-" request.
    p.handle(NotificationReceived("D#0", registration("r-bbbbbbbb", "r-cccccccc")), 0.0)
    assert matched() == {"r-bbbbbbbb": ["D#0"]}
    # D's own id, equal to P's.
    p.handle(NotificationReceived("E#0", registration("", "s-eeeeeeee")), 0.0)
    assert matched() == {"r-bbbbbbbb": ["D#0"], "s-eeeeeeee": ["E#0"]}
    # Only the base id is shared: the one request of that base still waiting.
    p.handle(NotificationReceived("F#0", registration("", "r-ffffffff")), 0.0)
    assert matched() == {"r-bbbbbbbb": ["D#0"], "s-eeeeeeee": ["E#0"], "r-aaaaaaaa": ["F#0"]}
    # Nothing shares "t": kept for later, not matched.
    p.handle(NotificationReceived("G#0", registration("", "t-00000000")), 0.0)
    assert len(matched()) == 3
    assert all(p.requests[r].state == "registered" for r in matched())
    p.handle(Admit("t-11111111", blocks(3)), 0.1)
    assert p.requests["t-11111111"].links.keys() == {"G#0"}
    assert not p.counters


@pytest.mark.parametrize("mode", MODES)
def test_unmatched_registration_expires_after_ttl(mode: Mode) -> None:
    ttl = FAST_CONFIG.pending_registration_ttl_s
    p = Producer(Identity("P"), mode, FAST_CONFIG)
    p.handle(NotificationReceived("D#0", registration("", "r-cccccccc")), 0.0)
    p.handle(Tick(), ttl - 0.01)
    assert p.counters["registration_expired"] == 0
    p.handle(NotificationReceived("D#0", registration("", "q-cccccccc")), ttl - 0.01)
    p.handle(Tick(), ttl)
    assert p.counters["registration_expired"] == 1
    p.handle(Admit("r-aaaaaaaa", blocks(1, 2)), ttl)
    assert p.requests["r-aaaaaaaa"].state == "allocated" and not p.requests["r-aaaaaaaa"].links
    p.handle(Admit("q-aaaaaaaa", blocks(1, 2)), ttl)  # the later one is still kept
    assert p.requests["q-aaaaaaaa"].state == "registered"
    p.handle(Tick(), 3 * ttl)
    assert p.counters["registration_expired"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_pending_registrations_are_bounded(mode: Mode) -> None:
    cluster = Cluster(mode, config=config(max_pending_registrations=2))
    warm(cluster)  # connected: P's refusal reaches D
    out = Outputs(cluster)
    t0 = cluster.network.now
    prs = [admit_d_only(cluster, f"r{i}", 2) for i in range(3)]
    run(cluster, 0.05)
    p = cluster.engines["P#0"].side
    assert p.counters["rejected"] == 1
    # The refused D knows at once (not at its watchdog) and reports its blocks invalid.
    [(t_fail, failed)] = out.of("D#0", prs[2].d_id, ReportFailed)
    assert t_fail - t0 < 0.1 and list(failed.blocks) == list(prs[2].d_blocks)
    assert prs[2].final == {"D#0": "failed"}
    # The two kept registrations are matched when P admits their requests.
    for pr in prs:
        admit_p(cluster, pr)
        cluster.finish_prefill(pr.key)
    settled(cluster)
    assert [pr.final for pr in prs[:2]] == [{"P#0": "done", "D#0": "done"}] * 2
    assert prs[2].final["P#0"] == "expired"  # nobody registered for it any more


# --- 2. leases ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_lease_expires_and_releases_blocks_once(mode: Mode) -> None:
    lease = FAST_CONFIG.lease_s
    cluster = Cluster(mode, config=config(watchdog_s=10.0))
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.network.drop_next_notif("P#0")  # D's registration
    cluster.finish_prefill("r")
    t0 = cluster.network.now
    run(cluster, lease - 0.05)
    assert state(cluster, "P#0", pr.p_id) == "leased" and out.releases("P#0", pr.p_id) == []
    run(cluster, 0.1)
    [(t_end, fin)] = out.finished("P#0", pr.p_id)
    assert fin.state == "expired" and t0 + lease <= t_end <= t0 + lease + 0.011
    assert out.releases("P#0", pr.p_id) == [t_end]
    settled(cluster)
    assert len(out.releases("P#0", pr.p_id)) == 1


@pytest.mark.parametrize("mode", MODES)
def test_heartbeats_extend_the_lease_while_matched(mode: Mode) -> None:
    c = config(watchdog_s=30.0)
    cluster = Cluster(mode, config=c)
    out = Outputs(cluster)
    cluster.directory.hang_next("D#0")  # P's handshake with D hangs: P stays matched
    pr = cluster.admit("r", 4)
    run_until(cluster, lambda: state(cluster, "P#0", pr.p_id) == "registered")
    cluster.finish_prefill("r")
    assert state(cluster, "P#0", pr.p_id) == "matched"
    run(cluster, 3 * c.lease_s)
    assert state(cluster, "P#0", pr.p_id) == "matched" and out.releases("P#0", pr.p_id) == []
    t_kill = cluster.network.now
    cluster.kill("D#0", reset=False)  # the heartbeats stop
    run_until(cluster, lambda: out.finished("P#0", pr.p_id), limit=c.lease_s + 0.1)
    [(t_end, fin)] = out.finished("P#0", pr.p_id)
    assert fin.state == "expired"
    assert c.lease_s - c.heartbeat_s - 0.02 <= t_end - t_kill <= c.lease_s + 0.02
    settled(cluster)
    assert out.releases("P#0", pr.p_id) == [t_end]


@pytest.mark.parametrize("mode", MODES)
def test_sweep_finds_every_expired_lease_when_heartbeats_reorder_deadlines(mode: Mode) -> None:
    rng = random.Random(1)
    lease = FAST_CONFIG.lease_s
    p = Producer(Identity("P"), mode, FAST_CONFIG)
    deadline: dict[str, float] = {}  # request -> when its lease ends (the model)
    d_ids: dict[str, str] = {}  # matched request -> D's id (heartbeats extend these)
    released: list[str] = []
    expired: list[str] = []

    def handle(event: Any, now: float) -> None:
        for cmd in p.handle(event, now):
            if isinstance(cmd, ReleaseBlocks):
                released.append(cmd.request_id)
            elif isinstance(cmd, Finished):
                assert cmd.state == "expired"
                expired.append(cmd.request_id)

    now = 0.0
    for i in range(400):
        rid = f"q{i}-{i:08x}"
        now += rng.choice([0.0, 0.001, 0.01])
        handle(Admit(rid, blocks(i)), now)
        if i % 3:  # registered by D (never connected): matched once the prefill finishes
            d_ids[rid] = f"q{i}-d{i:07x}"
            handle(NotificationReceived("D#0", registration("", d_ids[rid])), now)
        handle(PrefillFinished(rid, blocks(i)), now)
        deadline[rid] = now + lease
    assert {r.state for r in p.requests.values()} == {"leased", "matched"}
    while deadline:
        now += rng.uniform(0.05, 0.6)
        alive = [r for r in d_ids if r in deadline]
        beats = rng.sample(alive, k=len(alive) // 2) if now < 8.0 else []
        for start in range(0, len(beats), 50):
            ids = beats[start : start + 50]
            # A heartbeat lands between deadlines: those not yet due move past later ones.
            ids = [r for r in ids if deadline[r] > now]
            handle(NotificationReceived("D#0", encode(Heartbeat([d_ids[r] for r in ids], 0))), now)
            for r in ids:
                deadline[r] = now + lease
        due = {r for r, at in deadline.items() if at <= now}
        before = len(expired)
        handle(Tick(), now)
        assert set(expired[before:]) == due
        for r in due:
            del deadline[r]
        assert p.next_wakeup() == (min(deadline.values()) if deadline else None)
    assert sorted(released) == sorted(expired) and len(set(released)) == 400
    assert expired != sorted(expired, key=lambda r: int(r[1 : r.index("-")]))  # reordered
    assert p.requests == {} and len(p.deadlines) == 0


# --- 3. D's watchdog and fence --------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_watchdog_reports_blocks_invalid_when_p_never_acts(mode: Mode) -> None:
    wd, fence = FAST_CONFIG.watchdog_s, FAST_CONFIG.fence_s
    # Without questions over the side channel (P would say it never heard of the request:
    # `test_status.py` has that).
    cluster = Cluster(mode, config=config(status_query_s=0.0))
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    cluster.network.drop_next_notif("P#0")  # D's registration: P never acts on it
    cluster.directory.hang_next("D#0")  # nor can it connect to D to acknowledge D's cancel
    cluster.finish_prefill("r")
    run(cluster, wd - 0.05)
    assert state(cluster, "D#0", pr.d_id) == "registered" and out.of("D#0", pr.d_id) == []
    run_until(cluster, lambda: out.of("D#0", pr.d_id, ReportFailed), limit=0.1)
    [(t_fail, failed)] = out.of("D#0", pr.d_id, ReportFailed)
    assert list(failed.blocks) == list(pr.d_blocks)
    if mode == "push":
        # P never connected to D, so nothing acknowledges D's cancel: the fence bound frees them.
        assert state(cluster, "D#0", pr.d_id) == "fencing" and out.releases("D#0", pr.d_id) == []
        run(cluster, fence - 0.1)
        assert state(cluster, "D#0", pr.d_id) == "fencing" and out.releases("D#0", pr.d_id) == []
    settled(cluster)
    [(t_end, fin)] = out.finished("D#0", pr.d_id)
    assert fin.state == "expired" and out.releases("D#0", pr.d_id) == [t_end]
    assert t_end >= t_fail + (fence if mode == "push" else 0.0)
    assert not out.of("D#0", pr.d_id, ReportReceived)


def test_push_fence_holds_blocks_until_p_acknowledges() -> None:
    wd, fence = FAST_CONFIG.watchdog_s, FAST_CONFIG.fence_s
    cluster = Cluster("push", config=config(status_query_s=0.0))  # the watchdog decides
    warm(cluster)
    out = Outputs(cluster)
    cluster.network.drop_next_notif("P#0")  # D's registration: P never learns of the request
    pr = admit_d_only(cluster, "r", 4)
    run(cluster, wd - 0.05)
    cluster.network.hold_notifs("D#0")  # P's acknowledgement waits here
    run_until(cluster, lambda: out.of("D#0", pr.d_id, ReportFailed), limit=0.1)
    [(t_fail, failed)] = out.of("D#0", pr.d_id, ReportFailed)
    assert list(failed.blocks) == list(pr.d_blocks)
    run(cluster, fence / 2)
    assert state(cluster, "D#0", pr.d_id) == "fencing" and out.releases("D#0", pr.d_id) == []
    assert cluster.network.release_held("D#0") >= 1
    cluster.step(0.01)
    [(t_end, fin)] = out.finished("D#0", pr.d_id)
    assert fin.state == "expired" and out.releases("D#0", pr.d_id) == [t_end]
    assert t_end - t_fail < fence
    admit_p(cluster, pr)
    cluster.finish_prefill("r")
    settled(cluster)
    assert pr.final == {"D#0": "expired", "P#0": "expired"}


# --- 7. prefix-cache hits on D --------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill_first", "cancel_first"])
def test_full_prefix_hit_releases_p_at_once(mode: Mode, prefill_first: bool) -> None:
    cluster = Cluster(mode)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4, d_cached=4)
    t0 = cluster.network.now
    assert len(pr.d_blocks) == 0
    if prefill_first:
        cluster.finish_prefill("r")
    run(cluster, 0.05)
    if not prefill_first:
        assert state(cluster, "P#0", pr.p_id) == "allocated"  # D's release noted
        cluster.finish_prefill("r")
    [(t_p, fin)] = out.finished("P#0", pr.p_id)
    assert fin.state == "done" and t_p - t0 < FAST_CONFIG.lease_s / 10
    assert "peer_cancelled" in [event for event, _, _ in fin.history]
    [(_, received)] = out.of("D#0", pr.d_id, ReportReceived)
    assert len(received.blocks) == 0
    settled(cluster)
    assert pr.final == {"P#0": "done", "D#0": "done"}
    assert out.releases("P#0", pr.p_id) == [t_p]


@pytest.mark.parametrize("mode", MODES)
def test_partial_prefix_hit_receives_only_the_last_blocks(mode: Mode) -> None:
    cluster = Cluster(mode)
    out = Outputs(cluster)
    pr = cluster.admit("r", 5, d_cached=2)
    cluster.finish_prefill("r")
    settled(cluster)
    assert pr.final == {"P#0": "done", "D#0": "done"}
    [(_, received)] = out.of("D#0", pr.d_id, ReportReceived)
    assert list(received.blocks) == list(pr.d_blocks) and len(pr.d_blocks) == 3
    assert cluster.ledger.verified_bytes == 3 * BLOCK_BYTES  # P's last 3 blocks, byte for byte


# --- 8. requests without blocks --------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_request_without_blocks_is_done_at_once(mode: Mode) -> None:
    cluster = Cluster(mode)
    pr = cluster.admit("r", 0)
    cluster.finish_prefill("r")
    assert pr.final["P#0"] == "done"
    settled(cluster)
    assert pr.final == {"P#0": "done", "D#0": "done"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("registered", [True, False], ids=["after_register", "before_register"])
def test_prefill_without_blocks_never_lets_d_succeed(mode: Mode, registered: bool) -> None:
    cluster = Cluster(mode)
    warm(cluster)  # connected: P's failure reaches D (cold: see test_core_faults.py)
    out = Outputs(cluster)
    pr = cluster.admit("r", 4)
    if registered:
        run_until(cluster, lambda: state(cluster, "P#0", pr.p_id) == "registered")
    cluster.finish_prefill("r", without_blocks=True)
    assert pr.final["P#0"] == ("failed" if registered else "done")
    run(cluster, 0.05)
    if registered:  # told by P, not by its watchdog
        assert pr.final["D#0"] == "failed"
    settled(cluster)
    assert pr.final["D#0"] in ("failed", "expired")
    [(_, failed)] = out.of("D#0", pr.d_id, ReportFailed)
    assert list(failed.blocks) == list(pr.d_blocks) and not out.of("D#0", pr.d_id, ReportReceived)


# --- 10. protocol errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_caller_event_out_of_order_raises_local_protocol_error(mode: Mode) -> None:
    p = Producer(Identity("P"), mode, FAST_CONFIG)
    p.handle(Admit("r-1", blocks(1, 2)), 0.0)
    p.handle(PrefillFinished("r-1", blocks(1, 2)), 0.0)
    with pytest.raises(LocalProtocolError) as info:
        p.handle(PrefillFinished("r-1", blocks(1, 2)), 0.5)
    err = info.value
    assert (err.request, err.side, err.state, err.event, err.fault) == (
        "r-1",
        "P",
        "leased",
        "prefill_finished",
        "caller",
    )
    for part in ("'r-1'", " P ", "'leased'", "'prefill_finished'", "caller"):
        assert part in str(err)
    assert p.requests["r-1"].state == "leased"  # unchanged; the request goes on
    out = p.handle(Tick(), FAST_CONFIG.lease_s)
    assert [c.request_id for c in out if isinstance(c, ReleaseBlocks)] == ["r-1"]
    assert [c.state for c in out if isinstance(c, Finished)] == ["expired"]


@pytest.mark.parametrize("mode", MODES)
def test_peer_message_out_of_order_is_counted_not_raised(mode: Mode) -> None:
    d = Consumer(Identity("D"), mode, FAST_CONFIG)
    assert d.handle(Admit("r-d", blocks(3, 4), "P", 1, "r-p"), 0.0) == [StartHandshake("P#0")]
    early = (
        Progress("r-d", "r-p", 0, 1)
        if mode == "push"
        else Grant("r-d", "r-p", 0, 1, pack_blocks([1, 2]), 10.0)
    )
    assert d.handle(NotificationReceived("P#0", encode(early)), 0.0) == []
    assert d.counters["protocol_error"] == 1 and "allocated" in d.errors[-1]
    assert d.requests["r-d"].state == "allocated"
    out = d.handle(HandshakeDone("P#0"), 0.1)  # and it goes on
    assert d.requests["r-d"].state == "registered"
    [sent] = [decode(c.payload) for c in out if isinstance(c, SendNotification)]
    assert isinstance(sent, Registration) and sent.sender_request_id == "r-d"
