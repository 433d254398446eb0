"""Stale peers are evicted after an idle TTL, releasing what the fabric holds for them; a peer a
live request still uses is kept however long that request lives."""

from __future__ import annotations

from typing import cast

import msgspec

from kvfsm.core import Mode
from kvfsm.fabric import SimFabric
from kvfsm.sim import FAST_CONFIG, Cluster

_CONFIG = msgspec.structs.replace(FAST_CONFIG, peer_idle_ttl_s=1.0, lease_s=10.0, watchdog_s=10.0)


def _peer_states(c: Cluster) -> dict[str, str]:
    return {f"{e.agent}->{p.id}": p.state for e in c.live_engines() for p in e.side.peers.values()}


def _remotes(c: Cluster) -> list[int]:
    fabrics = [e.fabric for e in c.live_engines()]
    assert all(isinstance(f, SimFabric) for f in fabrics)
    return [cast(SimFabric, f).open_resources()["remote_agents"] for f in fabrics]


def test_idle_peers_are_evicted_and_reconnected_on_demand() -> None:
    for mode in ("push", "pull"):
        c = Cluster(mode, config=_CONFIG)
        assert c.serve("r1", 2) == {"P#0": "done", "D#0": "done"}
        assert set(_peer_states(c).values()) == {"connected"}
        remotes = _remotes(c)
        assert remotes == [1, 1]
        for _ in range(4):  # 2 s: past the TTL and the half-TTL sweep
            c.step(0.5)
        assert set(_peer_states(c).values()) == {"evicted"}, mode
        assert _remotes(c) == [0, 0]
        assert c.serve("r2", 2) == {"P#0": "done", "D#0": "done"}  # a new request handshakes again
        assert set(_peer_states(c).values()) == {"connected"}
        assert c.ledger.quiescence() == []


def test_a_peer_in_use_is_kept_past_the_ttl() -> None:
    mode: Mode = "push"
    c = Cluster(mode, config=_CONFIG)
    c.admit("slow", 2)  # P's prefill runs 5 TTLs; D's registration waits on P meanwhile
    for _ in range(10):
        c.step(0.5)
        assert _peer_states(c)["D#0->P#0"] == "connected"  # (P connects back at the match)
    c.finish_prefill("slow")
    c.settle()
    assert c.requests["slow"].final == {"P#0": "done", "D#0": "done"}
