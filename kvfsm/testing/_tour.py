"""A scripted tour of the rare corners of the lifecycles, on real engines and the simulated fabric.

The stateful suite explores at random; some transitions need a precise interleaving (an abort while
a READ is in flight and P has already failed, a third handle of a request ending after two failed)
that random search reaches only in long soaks. Each interleaving here is scripted on a cluster and
then lets the cluster settle, so the safety ledger checks it like any other run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from kvfsm.core import Drain, Mode, NotificationReceived, PrefillFinished, Shutdown
from kvfsm.fabric import SimFaults
from kvfsm.sim import Cluster
from kvfsm.testing._states import abandon_in, live_states
from kvfsm.wire import Goodbye, encode

__all__ = ["INTERLEAVINGS", "Interleaving", "run_tour"]

_SLOW = SimFaults(transfer_latency=0.25)
Interleaving = Callable[[Mode], Cluster]
"""Builds a cluster and scripts one interleaving on it, in the given mode."""


def _cluster(mode: Mode, p_tp: int = 1, d_tp: int = 1, slow: bool = True) -> Cluster:
    return Cluster(mode, p_tp=p_tp, d_tp=d_tp, faults=_SLOW if slow else None, num_blocks=24)


def _state(c: Cluster, agent: str, key: str) -> str:
    pr = c.requests[key]
    rid = pr.p_id if agent.startswith("P") else pr.d_id
    req = c.engines[agent].side.requests.get(rid)
    return req.state if req is not None else pr.final.get(agent, "gone")


def _until(c: Cluster, agent: str, key: str, *states: str, limit: float = 10.0) -> None:
    end = c.network.now + limit
    while _state(c, agent, key) not in states:
        if c.network.now > end:
            raise AssertionError(f"{agent} {key} never reached {states}: {_state(c, agent, key)}")
        c.step(1e-3)


def _transferring(mode: Mode) -> str:
    return "writing" if mode == "push" else "reading"


def _mid_transfer(mode: Mode, outcome: str | None = None, p_tp: int = 1) -> Cluster:
    """One request whose transfer is in flight (its post scripted to `outcome`, if given)."""
    c = _cluster(mode, p_tp=p_tp)
    if outcome is not None:
        poster = "D#0" if mode == "pull" else "P#0"
        c.network.inject_next_post(poster, outcome)  # type: ignore[arg-type]
    c.admit("r", 2)
    c.finish_prefill("r")
    _until(c, "D#0", "r", _transferring(mode))
    return c


def d_aborts_mid_transfer(mode: Mode) -> Cluster:
    """D aborts while the transfer is in flight; then again (idempotent)."""
    c = _mid_transfer(mode)
    c.abort("r", "D")
    c.abort("r", "D")
    return c


def d_aborts_stuck_transfer(mode: Mode) -> Cluster:
    """D aborts while the transfer hangs in PROC: the stall bound ends it."""
    c = _mid_transfer(mode, "stuck")
    c.abort("r", "D")
    return c


def d_aborts_failing_transfer(mode: Mode) -> Cluster:
    """D aborts while a transfer that will end in ERR is in flight."""
    c = _mid_transfer(mode, "err")
    c.abort("r", "D")
    return c


def p_aborts_mid_transfer(mode: Mode, outcome: str | None = None) -> Cluster:
    """P aborts while the transfer is in flight (optionally stuck or failing); D hears of it
    mid-transfer; P aborts again."""
    c = _mid_transfer(mode, outcome)
    c.abort("r", "P")
    c.step(1e-3)
    c.abort("r", "P")
    return c


def p_aborts_stuck(mode: Mode) -> Cluster:
    """P aborts while the transfer hangs."""
    return p_aborts_mid_transfer(mode, "stuck")


def p_aborts_failing(mode: Mode) -> Cluster:
    """P aborts while the transfer will fail."""
    return p_aborts_mid_transfer(mode, "err")


def p_dies_mid_transfer(mode: Mode) -> Cluster:
    """P's host resets connections while the transfer is in flight."""
    c = _mid_transfer(mode)
    c.kill("P#0", reset=True)
    return c


def d_replaced_mid_transfer(mode: Mode) -> Cluster:
    """D goes silent mid-transfer and a new process takes its place: P learns that D is lost
    while its WRITE is still in flight (push), and the WRITE's end decides the request."""
    c = _mid_transfer(mode)
    c.kill("D#0", reset=False)
    c.revive("D#0")
    c.step(1e-3)  # P polls before the WRITE's own end
    return c


def d_dies_while_p_drains(mode: Mode) -> Cluster:
    """D's host resets while P drains an aborted transfer."""
    c = _mid_transfer(mode)
    c.kill("D#0", reset=True)
    c.abort("r", "P")
    return c


def handshake_hangs(mode: Mode) -> Cluster:
    """D's handshake with P never answers: the watchdog ends the request, also a full hit."""
    c = _cluster(mode, slow=False)
    c.directory.hang_next("P#0", times=2)
    c.admit("r", 2)
    c.admit("hit", 2, d_cached=2)
    c.finish_prefill("r")
    c.finish_prefill("hit")
    return c


def p_cannot_reach_d(mode: Mode) -> Cluster:
    """P's handshake with D hangs: P waits in matched, then is aborted, or D's heartbeats stop."""
    c = _cluster(mode, slow=False)
    c.directory.hang_next("D#0", times=1)
    c.admit("a", 2)
    c.finish_prefill("a")
    _until(c, "P#0", "a", "matched")
    c.abort("a", "P")
    c.directory.hang_next("D#0", times=1)
    c.admit("b", 2)
    c.finish_prefill("b")
    _until(c, "P#0", "b", "matched")
    c.kill("D#0", reset=False)
    return c


def late_results_while_fencing(mode: Mode) -> Cluster:
    """D's notifications are held until its watchdog fired: the late ones are recognised."""
    c = _cluster(mode, slow=False)
    c.admit("r", 2)
    _until(c, "D#0", "r", "registered")
    c.network.hold_notifs("D#0")
    c.finish_prefill("r")
    _until(c, "P#0", "r", "done", "reading")
    c.step(2.5)
    c.network.release_held("D#0")
    return c


def d_fences_a_silent_rank_after_losing_one(mode: Mode) -> Cluster:
    """D registered with both P ranks; one goes silent, then the other's host resets: D learns
    of the loss, fences the silent one, and its fence runs out."""
    c = _cluster(mode, p_tp=2, slow=False)
    c.admit("r", 2)
    _until(c, "D#0", "r", "registered")
    c.kill("P#0", reset=False)
    c.kill("P#1", reset=True)
    return c


def p_loses_a_late_consumer_mid_transfer(mode: Mode) -> Cluster:
    """One D rank's registration comes late, after P began moving KV for the other; P's
    handshake back with it is refused: P fails that rank's share mid-transfer."""
    c = _cluster(mode, d_tp=2)
    c.directory.hang_next("P#0", seconds=0.5)  # D#0's handshake: it registers late
    c.admit("r", 2)
    c.finish_prefill("r")
    _until(c, "P#0", "r", _transferring(mode))
    c.directory.fail_next("D#0")
    return c


def two_consumers_register_early(mode: Mode) -> Cluster:
    """Two D ranks register before P's prefill ends; one handshake fails, then D gives up."""
    c = _cluster(mode, d_tp=2, slow=False)
    c.directory.fail_next("D#1")
    c.admit("a", 2, d_first=True)
    c.step(5e-3)
    c.finish_prefill("a")
    c.directory.hang_next("D#1")
    c.admit("b", 2, d_first=True)
    c.step(2.5)
    c.finish_prefill("b")
    return c


def two_producers_one_grant_late(mode: Mode) -> Cluster:
    """D reads from two P ranks; it aborts after the first grant, the second arrives late."""
    c = _mid_transfer(mode, p_tp=2)
    c.abort("r", "D")
    return c


def many_handles_some_fail(mode: Mode) -> Cluster:
    """Four handles, the first two fail: the request fails only once all four ended."""
    c = _cluster(mode, p_tp=4 if mode == "pull" else 1, d_tp=1 if mode == "pull" else 4)
    poster = "D#0" if mode == "pull" else "P#0"
    c.network.inject_next_post(poster, "err")
    c.network.inject_next_post(poster, "err")
    c.admit("r", 2)
    c.finish_prefill("r")
    return c


def late_grant_while_draining(mode: Mode) -> Cluster:
    """D reads from two P ranks; one connects late, after D gave up on the first one's data."""
    c = _cluster(mode, p_tp=2)
    c.directory.hang_next("D#0", seconds=0.1)
    c.admit("r", 2)
    c.finish_prefill("r")
    _until(c, "D#0", "r", _transferring(mode))
    c.abort("r", "D")
    return c


def p_drains_while_consumers_arrive(mode: Mode) -> Cluster:
    """P aborts while one D rank transfers; the other D rank's registration arrives only then."""
    c = _cluster(mode, d_tp=2)
    c.directory.hang_next("P#0", seconds=0.1)  # D#0 connects to P, and registers, late
    c.admit("r", 2)
    c.finish_prefill("r")
    _until(c, "D#1", "r", _transferring(mode))
    c.abort("r", "P")
    return c


def p_drains_while_connecting(mode: Mode) -> Cluster:
    """P aborts while one D rank transfers; its connection to the other comes up only then."""
    c = _cluster(mode, d_tp=2)
    c.directory.hang_next("D#0", seconds=0.1)  # P's connection to D#0 comes late
    c.admit("r", 2)
    c.finish_prefill("r")
    _until(c, "D#1", "r", _transferring(mode))
    c.abort("r", "P")
    return c


def consumers_withdraw_while_p_connects(mode: Mode) -> Cluster:
    """Both D ranks register before P's prefill ends, then give up while P still connects."""
    c = _cluster(mode, d_tp=2, slow=False)
    for peer in ("D#0", "D#1"):
        c.directory.hang_next(peer, seconds=0.5)
    c.directory.fail_next("D#1")
    c.admit("r", 2)
    _until(c, "D#1", "r", "registered")
    c.step(5e-3)
    c.abort("r", "D")
    c.step(0.01)  # the cancels reach P while its handshakes still hang
    c.step(0.6)  # then one handshake completes and one fails
    return c


def peer_lost_while_p_drains(mode: Mode) -> Cluster:
    """P drains a hung transfer when D goes silent and a new process takes its place."""
    c = _mid_transfer(mode, "stuck")
    c.abort("r", "P")
    c.kill("D#0", reset=False)
    c.revive("D#0")
    c.step(1e-3)  # P polls before the WRITE's own end
    return c


def p_replaced_mid_transfer(mode: Mode) -> Cluster:
    """P goes silent and a new process takes its place while two transfers hang, one of them
    already given up by D: both fail when polled, and the peer is lost once."""
    c = _cluster(mode)
    poster = "D#0" if mode == "pull" else "P#0"
    for key in ("a", "b"):
        c.network.inject_next_post(poster, "stuck")
        c.admit(key, 2)
        c.finish_prefill(key)
        _until(c, "D#0", key, _transferring(mode))
    c.abort("b", "D")
    c.kill("P#0", reset=False)
    c.revive("P#0")
    return c


def second_consumer_registers_mid_transfer(mode: Mode) -> Cluster:
    """Of two D ranks, one registers only while P already transfers to the other."""
    c = _cluster(mode, d_tp=2)
    c.directory.hang_next("P#0", seconds=0.1)  # D#0 connects to P, and registers, late
    c.admit("r", 2)
    c.finish_prefill("r")
    _until(c, "D#0", "r", _transferring(mode))
    return c


def consumer_lost_before_prefill_ends(mode: Mode) -> Cluster:
    """D registered two requests and dies; P learns it when it next tells D something."""
    c = _cluster(mode, slow=False)
    c.admit("warm", 1)
    c.finish_prefill("warm")
    _until(c, "P#0", "warm", "done")  # P and D are connected both ways
    c.admit("waits", 1, d_first=True)
    c.admit("empty", 1, d_first=True)
    _until(c, "P#0", "empty", "registered")
    _until(c, "P#0", "waits", "registered")
    c.kill("D#0", reset=True)
    c.finish_prefill("empty", without_blocks=True)  # P tells D: the send fails, D is lost
    return c


def one_of_two_producers_lost(mode: Mode) -> Cluster:
    """D receives from two P ranks; one dies (its host resetting) mid-transfer; then, in two more
    requests, after its part completed, while the other rank has not started (it acknowledges
    D's cancel) or starts before the cancel reaches it (its completion comes late)."""
    c = _mid_transfer(mode, p_tp=2)
    c.kill("P#0", reset=True)
    c.settle()
    for key, p1_starts_first in (("acked", False), ("late", True)):
        c.revive("P#0")
        pr = c.admit(key, 2)
        c.step(0.01)
        c.engines["P#0"].submit(PrefillFinished(pr.p_id, pr.p_blocks))  # only P#0's prefill ends
        _until(c, "P#0", key, _transferring(mode), "done")
        for dt in (0.3, 0.01):  # P#0's part lands and D hears its completion
            c.step(dt)
        c.kill("P#0", reset=True)
        c.step(0.6)  # D's heartbeat finds P#0 gone and D cancels with P#1
        if p1_starts_first:
            c.finish_prefill(key)
        c.step(0.01)
        c.finish_prefill(key)
        c.settle()
    return c


def d_gives_up_while_p_connects(mode: Mode) -> Cluster:
    """P matched D's registration and still connects to D when D gives up."""
    c = _cluster(mode, slow=False)
    c.directory.hang_next("D#0", seconds=0.5)
    c.admit("r", 2)
    c.finish_prefill("r")
    _until(c, "P#0", "r", "matched")
    c.abort("r", "D")
    c.step(0.01)
    return c


def cancel_overtakes_registration(mode: Mode) -> Cluster:
    """D registers with two P ranks and gives up at once; its registration to one rank is
    delayed past its cancel (found by the soak: that rank acknowledged, then matched the late
    registration and wrote into blocks D had released)."""
    c = _cluster(mode, p_tp=2)
    c.network.delay_next_notif("P#0", 0.001)
    c.admit("r", 1)
    c.step(3.5)  # handshakes and the watchdog land in the same poll: register, then give up
    for dt in (1e-4, 1e-3):
        c.step(dt)
    c.finish_prefill("r")
    for _ in range(5):  # the acknowledgements reach D while any WRITE would still be in flight
        c.step(1e-3)
    return c


def _engine_until(c: Cluster, agent: str, state: str, limit: float = 10.0) -> None:
    end = c.network.now + limit
    while c.engines[agent].side.engine.state != state:
        if c.network.now > end:
            raise AssertionError(f"{agent} never reached {state}")
        c.step(1e-3)


def _peer_until(c: Cluster, agent: str, peer: str, state: str, limit: float = 10.0) -> None:
    end = c.network.now + limit
    while (p := c.engines[agent].side.peers.get(peer)) is None or p.state != state:
        if c.network.now > end:
            raise AssertionError(f"{agent}'s peer {peer} never reached {state}")
        c.step(1e-3)


def _goodbye(c: Cluster, sender: str, to: str) -> None:
    """A goodbye from `sender` reaches `to` (at whatever state `to` holds `sender` in)."""
    c.engines[to].submit(NotificationReceived(sender, encode(Goodbye(0, 1))))
    c.collect()


def engine_drains_mid_transfer(mode: Mode) -> Cluster:
    """P drains (asked twice) while a transfer moves: it ends, P is drained and says goodbye
    (D unloads it), is asked once more, then shut down (a second goodbye)."""
    c = _mid_transfer(mode)
    p = c.engines["P#0"]
    p.submit(Drain())
    p.submit(Drain())
    _engine_until(c, "P#0", "drained")
    p.submit(Drain())
    p.submit(Shutdown())
    c.collect()
    return c


def d_drains_before_its_load(mode: Mode) -> Cluster:
    """D drains with a load admitted: the load finishes, then D says goodbye to P."""
    c = _cluster(mode)
    c.admit("r", 2)
    c.engines["D#0"].submit(Drain())
    c.finish_prefill("r")
    _engine_until(c, "D#0", "drained")
    _peer_until(c, "P#0", "D#0", "evicted")
    return c


def engine_shut_down_while_draining(mode: Mode) -> Cluster:
    """P is shut down while it drains a transfer in flight (no goodbye to D: it uses P)."""
    c = _mid_transfer(mode)
    c.engines["P#0"].submit(Drain())
    c.engines["P#0"].submit(Shutdown())
    c.collect()
    return c


def p_drains_with_leases_held(mode: Mode) -> Cluster:
    """P drains holding one request matched (its handshake back to D hangs) and one leased (D's
    registration still on its way): both leases are cut, D hears `draining`."""
    c = _cluster(mode)
    c.directory.hang_next("D#0", seconds=60.0)
    c.admit("m", 2)
    c.finish_prefill("m")
    p_id = c.requests["m"].p_id
    for _ in range(1000):
        if getattr(c.engines["P#0"].side.requests.get(p_id), "state", None) == "matched":
            break
        c.step(0.001)
    c.admit("l", 2)
    c.finish_prefill("l")
    c.engines["P#0"].submit(Drain())
    c.collect()
    return c


def goodbye_to_a_failed_peer(mode: Mode) -> Cluster:
    """A goodbye reaches D while its handshakes with P fail."""
    c = _cluster(mode, slow=False)
    c.directory.fail_next("P#0", times=1000)
    c.admit("a", 2)
    _peer_until(c, "D#0", "P#0", "failed")
    _goodbye(c, "P#0", "D#0")
    return c


def goodbyes_before_a_connection(mode: Mode) -> Cluster:
    """Goodbyes reach P while it only knows D's contact, then while it connects to D."""
    c = _cluster(mode, slow=False)
    c.directory.hang_next("D#0", seconds=0.2)
    c.admit("b", 2)  # P's prefill is not finished: D's registration leaves it registered
    _until(c, "P#0", "b", "registered")
    _peer_until(c, "P#0", "D#0", "unknown")
    _goodbye(c, "D#0", "P#0")
    c.finish_prefill("b")  # P connects to D: the handshake hangs a while
    _peer_until(c, "P#0", "D#0", "handshaking")
    _goodbye(c, "D#0", "P#0")
    return c


INTERLEAVINGS: tuple[Interleaving, ...] = (
    d_aborts_mid_transfer,
    d_aborts_stuck_transfer,
    d_aborts_failing_transfer,
    p_aborts_mid_transfer,
    p_aborts_stuck,
    p_aborts_failing,
    p_dies_mid_transfer,
    d_replaced_mid_transfer,
    d_dies_while_p_drains,
    handshake_hangs,
    p_cannot_reach_d,
    late_results_while_fencing,
    d_fences_a_silent_rank_after_losing_one,
    p_loses_a_late_consumer_mid_transfer,
    two_consumers_register_early,
    two_producers_one_grant_late,
    many_handles_some_fail,
    late_grant_while_draining,
    p_drains_while_consumers_arrive,
    p_drains_while_connecting,
    consumers_withdraw_while_p_connects,
    peer_lost_while_p_drains,
    p_replaced_mid_transfer,
    second_consumer_registers_mid_transfer,
    consumer_lost_before_prefill_ends,
    one_of_two_producers_lost,
    d_gives_up_while_p_connects,
    cancel_overtakes_registration,
    engine_drains_mid_transfer,
    d_drains_before_its_load,
    engine_shut_down_while_draining,
    p_drains_with_leases_held,
    goodbye_to_a_failed_peer,
    goodbyes_before_a_connection,
)


def run_tour(mode: Mode) -> dict[str, list[str]]:
    """Run every interleaving in `mode`, then a bug in every live state of both sides (the
    runtime's `CommandFailed`), settle each, and return its safety problems by name."""
    runs: list[tuple[str, Callable[[], Cluster]]] = [
        (i.__name__, functools.partial(i, mode)) for i in INTERLEAVINGS
    ]
    runs += [
        (f"bug_in_{side}_{state}", functools.partial(abandon_in, mode, side, state))
        for side in ("P", "D")
        for state in live_states(mode, side)
    ]
    problems = {}
    for name, build in runs:
        cluster = build()
        for key in sorted(cluster.requests):
            cluster.finish_prefill(key)
        cluster.settle()
        found = cluster.ledger.quiescence()
        found += cluster.conformance.violations if cluster.conformance else []
        problems[name] = found
    return problems
