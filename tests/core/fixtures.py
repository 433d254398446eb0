"""What the core's and runtime's tests share: a cluster's outputs by agent and request, running
a cluster until something holds, admitting one side at a time, and registrations by hand."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kvfsm.core import (
    Admit,
    CoreConfig,
    Finished,
    Mode,
    ReleaseBlocks,
    ReportReceived,
)
from kvfsm.sim import FAST_CONFIG, Cluster, PairedRequest
from kvfsm.wire import Registration, encode, pack_blocks

MODES: tuple[Mode, ...] = ("push", "pull")
BLOCK_BYTES = 512  # a block of Cluster's model, all heads (TP ranks hold slices)


def blocks(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


# --- a Cluster, watched -------------------------------------------------------------------------


class Outputs:
    """Every caller output of a cluster's engines, with the simulated time it came out."""

    def __init__(self, cluster: Cluster) -> None:
        self.log: list[tuple[float, str, Any]] = []
        inner = cluster._on_output

        def record(agent: str, out: Any) -> None:
            self.log.append((cluster.network.now, agent, out))
            inner(agent, out)

        cluster._on_output = record  # type: ignore[method-assign]

    def of(self, agent: str, rid: str, *kinds: type) -> list[tuple[float, Any]]:
        return [
            (t, o)
            for t, a, o in self.log
            if a == agent
            and getattr(o, "request_id", None) == rid
            and (not kinds or isinstance(o, kinds))
        ]

    def releases(self, agent: str, rid: str) -> list[float]:
        """When `agent` handed the request's blocks back (ReleaseBlocks, or D's ReportReceived)."""
        return [t for t, _ in self.of(agent, rid, ReleaseBlocks, ReportReceived)]

    def finished(self, agent: str, rid: str) -> list[tuple[float, Finished]]:
        return self.of(agent, rid, Finished)


def state(cluster: Cluster, agent: str, rid: str) -> str | None:
    req = cluster.engines[agent].side.requests.get(rid)
    return None if req is None else req.state


def run(cluster: Cluster, seconds: float, dt: float = 0.01) -> None:
    for _ in range(round(seconds / dt)):
        cluster.step(dt)


def run_until(cluster: Cluster, done: Any, limit: float = 1.0, dt: float = 0.01) -> None:
    end = cluster.network.now + limit
    while not done():
        assert cluster.network.now < end, "condition not reached in time"
        cluster.step(dt)


def settled(cluster: Cluster) -> None:
    """Every request ended, every block released once, every step conformed to the models."""
    cluster.settle()
    assert cluster.ledger.quiescence() == []
    assert cluster.conformance is not None and cluster.conformance.violations == []


def admit_d_only(cluster: Cluster, key: str, n: int, **kw: Any) -> PairedRequest:
    """Admit `key` on D only (P admits it later with `admit_p`), so D's registration reaches P
    before P knows the request."""
    cluster._admit_p = lambda pr: None  # type: ignore[method-assign]
    try:
        return cluster.admit(key, n, **kw)
    finally:
        del cluster._admit_p


def admit_p(cluster: Cluster, pr: PairedRequest) -> None:
    for engine in cluster.live("P"):
        engine.submit(Admit(pr.p_id, pr.p_blocks))
    cluster.collect()


def warm(cluster: Cluster) -> None:
    """One request end to end, so P and D are connected both ways."""
    cluster.admit("warm", 1)
    cluster.finish_prefill("warm")
    cluster.settle()
    assert set(cluster.requests["warm"].final.values()) == {"done"}


def config(**changes: Any) -> CoreConfig:
    return msgspec.structs.replace(FAST_CONFIG, **changes)


# --- cores driven directly --------------------------------------------------------------------


def registration(
    p_id: str,
    d_id: str,
    ids: tuple[int, ...] = (1, 2),
    rank: int = 0,
    tp: int = 1,
    deadline: float = 1e9,
) -> bytes:
    return encode(Registration(p_id, d_id, rank, tp, "D", pack_blocks(list(ids)), deadline))
