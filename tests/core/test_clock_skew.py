"""P and D on hosts whose clocks differ: deadlines crossing between them (D's registration
deadline in push, P's grant deadline in pull) are converted with the offset each handshake
measures, taken on the early side."""

from __future__ import annotations

import msgspec
import pytest

from kvfsm.core import Mode, Side
from kvfsm.sidechannel import clock_offset
from kvfsm.sim import FAST_CONFIG, Cluster

SKEWS = [{"P": 3e5}, {"D": 3e5}, {"P": -50.0}, {"D": -7.5}]


def _serve(mode: Mode, skew: dict[str, float]) -> Cluster:
    c = Cluster(mode, clock_skew=skew, handshake_latency=0.01)
    for i in range(3):
        c.admit(f"r{i}", 2, d_first=bool(i % 2))
        c.finish_prefill(f"r{i}")
    c.settle()
    return c


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("skew", SKEWS, ids=str)
def test_requests_are_served_across_skewed_clocks(mode: Mode, skew: dict[str, float]) -> None:
    c = _serve(mode, skew)
    assert c.ledger.quiescence() == []
    finals = {state for pr in c.requests.values() for state in pr.final.values()}
    assert finals == {"done"}
    for engine in c.live_engines():
        for peer in engine.side.peers.values():
            true = c.clock_skew[peer.id[0]] - c.clock_skew[engine.agent[0]]
            assert peer.clock_error > 0  # half the directory's 10 ms latency
            assert abs(peer.clock_offset - true) <= peer.clock_error + 1e-9


@pytest.mark.parametrize(("mode", "skew"), [("push", {"P": 3e5}), ("pull", {"D": 3e5})])
def test_raw_deadlines_would_fail_every_request(
    monkeypatch: pytest.MonkeyPatch, mode: Mode, skew: dict[str, float]
) -> None:
    """The control: comparing the other host's deadline with our clock unconverted."""
    monkeypatch.setattr(Side, "_local_time", lambda self, agent, t: t)
    c = _serve(mode, skew)
    finals = {state for pr in c.requests.values() for state in pr.final.values()}
    assert finals == {"failed"}


def test_offset_estimate_brackets_the_truth() -> None:
    # The peer's clock is 1000 ahead. We send at 10; the request travels 0.1 s, the peer holds
    # it 5 s, the answer travels 0.3 s: the hold costs no precision, the uneven travel does.
    offset, error = clock_offset(10.0, 1010.1, 1015.1, 15.4)
    assert error == pytest.approx(0.2)
    assert abs(offset - 1000.0) <= error
    assert offset == pytest.approx(999.9)
    assert clock_offset(5.0, 5.0, 5.0, 4.0)[1] == 0.0  # a clock that went backwards bounds nothing


def test_a_handshake_held_long_by_the_peer_keeps_the_offset_precise() -> None:
    """A listener that answers after 60 s: the offset is still known to the transport's
    latency, so later grants and registrations keep their full margin."""
    config = msgspec.structs.replace(FAST_CONFIG, peer_idle_ttl_s=600.0)  # no idle eviction
    c = Cluster("pull", clock_skew={"P": 500.0}, handshake_latency=0.01, config=config)
    c.directory.hang_next("P#0", seconds=60.0)
    c.admit("r0", 2)
    c.finish_prefill("r0")
    for _ in range(3):  # past the hang: the handshake finishes; r0 expired meanwhile
        c.step(30.0)
    assert c.engines["D#0"].side.peers["P#0"].state == "connected"
    c.admit("r1", 2)
    c.finish_prefill("r1")
    c.settle()
    peer = c.engines["D#0"].side.peers["P#0"]
    assert peer.clock_error == pytest.approx(0.005)
    assert c.requests["r1"].final == {"P#0": "done", "D#0": "done"}


def test_a_slow_handshake_cannot_widen_what_earlier_ones_measured() -> None:
    """A handshake answered only after an outage (a long round trip) says little about the
    peer's clock; taken as it is, every deadline from that peer would look seconds early for
    good (found by tests/netns: no grant or registration was honoured after a restart)."""
    from kvfsm.core import Peer

    peer = Peer("D#0")
    peer.measured(100.0, 0.001)
    peer.measured(97.0, 3.5)  # consistent, but 3,500 times vaguer: nothing changes
    assert (peer.clock_offset, peer.clock_error) == pytest.approx((100.0, 0.001))
    peer.measured(100.0005, 0.001)  # consistent and as tight: the overlap is kept
    assert peer.clock_offset == pytest.approx(100.00025)
    assert peer.clock_error == pytest.approx(0.00075)
    peer.measured(500.0, 0.002)  # disjoint: the peer's clock is another one now
    assert (peer.clock_offset, peer.clock_error) == (500.0, 0.002)
