"""Over real NIXL: an idle peer's remote agent is unloaded after the TTL, and the next request
loads it again."""

from __future__ import annotations

import time
from typing import cast

import msgspec
import pytest

from kvfsm.fabric import NixlFabric
from kvfsm.sim import FAST_CONFIG, Cluster

pytestmark = pytest.mark.nixl

# Longer than a request's life on a loaded machine: the first check sees the agents still loaded.
_CONFIG = msgspec.structs.replace(FAST_CONFIG, peer_idle_ttl_s=2.0)
_BOUND_S = 20.0  # a safety bound on the wait, not a timing assertion


def _remotes(c: Cluster) -> list[int]:
    return [cast(NixlFabric, e.fabric).open_resources()["remote_agents"] for e in c.live_engines()]


def test_idle_remote_agents_are_unloaded_and_reloaded() -> None:
    c = Cluster("pull", config=_CONFIG, fabric="nixl")
    try:
        assert c.serve("r1", 2) == {"P#0": "done", "D#0": "done"}
        assert _remotes(c) == [1, 1]
        end = time.monotonic() + _BOUND_S
        while _remotes(c) != [0, 0] and time.monotonic() < end:
            c.step(0.01)  # on real NIXL: a poll every millisecond, time passing on its own
        assert _remotes(c) == [0, 0]
        assert c.serve("r2", 2) == {"P#0": "done", "D#0": "done"}
        assert _remotes(c) == [1, 1]
        assert c.ledger.quiescence() == []
    finally:
        c.close()
