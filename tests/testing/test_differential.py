"""The stateful machine's operations that both fabrics support (admit on either side first, with
or without a prefix-cache hit, prefill with or without KV, aborts on either side, time passing),
run on `SimFabric` and on real NIXL agents, end in the same final states with the same bytes,
and keep the safety properties on both.

Hypothesis draws the scripts; each runs as one `Cluster` per fabric with the same seed (so the
same request ids, blocks and bytes). Operations apply at points where their outcome does not hang
on how fast messages travel (right after an admission, or once D has registered): the real
fabric cannot be told to drop or delay a message, so races are the simulated fabric's job."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvfsm.core import CoreConfig, Mode
from kvfsm.fabric import UcxErrorHandling
from kvfsm.sim import Cluster

pytestmark = pytest.mark.nixl

# Deadlines long enough for a loaded machine, short enough that a lease runs out in a test.
_CONFIG = CoreConfig(
    lease_s=2.0,
    watchdog_s=20.0,
    stall_s=10.0,
    producer_stall_s=15.0,
    fence_s=20.0,
    heartbeat_s=0.5,
    pending_registration_ttl_s=20.0,
)
_WHAT = ("plain", "no-kv", "abort-p-early", "abort-d-early", "abort-d-registered")


_UCX_ERRORS: UcxErrorHandling = "none"
"""UCX's error handling on the real fabric here: with "none" it moves everything over shared
memory on one host, and TCP stays out (`_no_tcp`)."""


@pytest.fixture(scope="module", autouse=True)
def _no_tcp() -> Iterator[None]:
    """UCX without its TCP transport. Over TCP a released transfer's bytes may still land until
    the kernel drops the connection, so D holds the blocks of a request it gave up on that long
    (12 s by default), and each script would wait for it in real time; over shared memory
    nothing lands late and D holds nothing. The protocol's outcomes are the same either way."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("UCX_TLS", "^tcp")
        yield


@dataclass(frozen=True)
class _Op:
    """One request's script."""

    blocks: int
    cached: int
    d_first: bool
    same_id: bool
    what: str


_MAX_OPS = 5
_MAX_BLOCKS = 5
_ops = st.builds(
    _Op,
    blocks=st.integers(0, _MAX_BLOCKS),
    cached=st.integers(0, 3),
    d_first=st.booleans(),
    same_id=st.booleans(),
    what=st.sampled_from(_WHAT),
)


def _play(cluster: Cluster, ops: list[_Op]) -> tuple[dict[str, dict[str, str]], dict[str, bytes]]:
    keys = [f"r{i}" for i in range(len(ops))]
    for key, op in zip(keys, ops, strict=True):
        cluster.admit(key, op.blocks, op.cached, op.d_first, op.same_id)
    for key, op in zip(keys, ops, strict=True):
        if op.what == "abort-p-early":
            cluster.abort(key, "P")
        elif op.what == "abort-d-early":
            cluster.abort(key, "D")
            cluster.abort(key, "P")  # the serving engine's part: P's request goes too
    for key, op in zip(keys, ops, strict=True):
        if op.what == "abort-d-registered" and _wait_registered(cluster, key):
            cluster.abort(key, "D")
    for key, op in zip(keys, ops, strict=True):
        cluster.finish_prefill(key, without_blocks=op.what == "no-kv")
    received = _received_bytes(cluster)
    cluster.settle(horizon=60.0)
    received |= _received_bytes(cluster)
    assert cluster.ledger.quiescence() == [], cluster.ledger.quiescence()
    return {k: dict(sorted(pr.final.items())) for k, pr in cluster.requests.items()}, received


def _wait_registered(cluster: Cluster, key: str) -> bool:
    """Let time pass until every D rank registered `key` (False if one never does: a full hit)."""
    pr = cluster.requests[key]
    for _ in range(20_000):
        states = [e.side.requests.get(pr.d_id) for e in cluster.live("D")]
        if any(r is None for r in states):
            return False
        if all(r is not None and r.state == "registered" for r in states):
            return True
        cluster.step(1e-3)
    raise AssertionError(f"{key} never registered")


def _received_bytes(cluster: Cluster) -> dict[str, bytes]:
    """Every D rank's bytes of every request it finished with `done`."""
    out = {}
    for key, pr in cluster.requests.items():
        for agent in cluster.agents("D"):
            if pr.final.get(agent) == "done" and len(pr.d_blocks):
                kv = cluster.engines[agent].kv
                g = kv.geometry
                out[f"{key}@{agent}"] = b"".join(
                    r.reshape(g.num_blocks, g.block_len)[pr.d_blocks].tobytes()
                    for r in kv.regions()
                )
    return out


# Each example starts real NIXL agents: a third of the profile's examples (100 in CI, over 800
# in `make soak`).
@settings(
    max_examples=max(5, settings().max_examples // 3),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    mode=st.sampled_from(["push", "pull"]),
    tp=st.sampled_from([(1, 1), (1, 2), (2, 1)]),
    ratio=st.sampled_from([1, 2]),
    ops=st.lists(_ops, min_size=1, max_size=_MAX_OPS),  # every request's blocks fit at once
    seed=st.integers(0, 2**16),
)
def test_sim_and_nixl_agree(
    mode: Mode, tp: tuple[int, int], ratio: int, ops: list[_Op], seed: int
) -> None:
    outcomes = []
    for fabric in ("sim", "nixl"):
        cluster = Cluster(
            mode,
            seed=seed,
            config=_CONFIG,
            num_blocks=_MAX_OPS * _MAX_BLOCKS,
            p_tp=tp[0],
            d_tp=tp[1],
            d_block_size=4 * ratio,
            fabric=fabric,
            ucx_error_handling=_UCX_ERRORS,
        )
        try:
            outcomes.append(_play(cluster, ops))
        finally:
            cluster.close()
    (sim_finals, sim_bytes), (real_finals, real_bytes) = outcomes
    assert sim_finals == real_finals
    assert sim_bytes.keys() == real_bytes.keys()
    for name, data in sim_bytes.items():
        assert np.array_equal(
            np.frombuffer(data, np.uint8), np.frombuffer(real_bytes[name], np.uint8)
        ), name


def test_the_scripts_reach_every_kind_of_ending() -> None:
    """The operations are not vacuous: on the real fabric they end requests done, failed,
    aborted and expired, and move bytes."""
    ops = [
        _Op(3, 0, False, False, "plain"),
        _Op(2, 1, True, False, "plain"),
        _Op(2, 0, False, True, "no-kv"),
        _Op(2, 0, False, False, "abort-p-early"),
        _Op(1, 0, True, False, "abort-d-early"),
        _Op(2, 0, False, False, "abort-d-registered"),
    ]
    cluster = Cluster(
        "push", config=_CONFIG, num_blocks=24, fabric="nixl", ucx_error_handling=_UCX_ERRORS
    )
    try:
        finals, received = _play(cluster, ops)
    finally:
        cluster.close()
    assert finals["r0"] == finals["r1"] == {"D#0": "done", "P#0": "done"}
    assert finals["r2"]["D#0"] == "failed"  # P had no KV: D reports its blocks invalid
    assert finals["r3"] == {"D#0": "failed", "P#0": "aborted"}
    assert finals["r4"] == {"D#0": "aborted", "P#0": "aborted"}
    # D gave up after registering; P, having matched the registration, fails the request.
    assert finals["r5"] == {"D#0": "aborted", "P#0": "failed"}
    assert set(received) == {"r0@D#0", "r1@D#0"} and cluster.ledger.verified_bytes > 0
