"""The runtime engine over the simulated fabric: how it plans and posts per peer (TP slices,
replicated KV, block-size ratios), what it refuses, and what it reports per request."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kvfsm.core import (
    Admit,
    Consumer,
    Finished,
    Identity,
    InternalError,
    Mode,
    PrefillFinished,
    Producer,
)
from kvfsm.fabric import FabricError, SimNetwork
from kvfsm.layout import KvGeometry
from kvfsm.runtime import Engine, KvCache, RequestTrace, plan_route
from kvfsm.sidechannel import LocalDirectory
from kvfsm.sim import SMALL_GEOMETRY, SMALL_MLA_GEOMETRY, Cluster

MODES = ["push", "pull"]


def _settle(cluster: Cluster) -> None:
    cluster.settle()
    assert cluster.ledger.quiescence() == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 4)])
def test_replicated_kv_moves_one_copy_per_d_rank(mode: Mode, p_tp: int, d_tp: int) -> None:
    cluster = Cluster(mode, p_tp=p_tp, d_tp=d_tp, geometry=SMALL_MLA_GEOMETRY)
    prs = [cluster.admit(f"r{i}", 3) for i in range(4)]
    for pr in prs:
        cluster.finish_prefill(pr.key)
    _settle(cluster)
    assert all(set(pr.final.values()) == {"done"} for pr in prs)
    posters = cluster.agents("P" if mode == "push" else "D")
    posted = sum(cluster.engines[a].counters["posted"] for a in posters)
    assert posted == 4 * d_tp  # every D rank holds the whole latent KV, from one P rank
    block = cluster.engines["D#0"].kv.block_bytes  # the whole latent: the same on every rank
    assert cluster.ledger.verified_bytes == 4 * d_tp * 3 * block


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("n", "cached"), [(7, 0), (7, 1), (8, 2), (5, 2), (3, 1)])
def test_bigger_d_blocks_pair_after_a_prefix_hit(mode: Mode, n: int, cached: int) -> None:
    # P's blocks hold 4 tokens, D's 8; D already holds its first `cached` blocks.
    cluster = Cluster(mode, d_block_size=8)
    pr = cluster.admit("r", n, d_cached=cached)
    cluster.finish_prefill("r")
    _settle(cluster)
    d_blocks = -(-n // 2) - cached
    assert len(pr.d_blocks) == d_blocks
    if d_blocks == 0:  # a full hit: nothing moves, P releases at once
        assert pr.final == {"P#0": "done", "D#0": "done"} and cluster.ledger.verified_bytes == 0
        return
    assert pr.final == {"P#0": "done", "D#0": "done"}
    tokens = n * 4 - cached * 8
    token_bytes = cluster.engines["D#0"].kv.block_bytes // 8
    assert cluster.ledger.verified_bytes == tokens * token_bytes  # every token D holds, no more


def _engines(
    mode: Mode, p: KvGeometry, d: KvGeometry, *, coalesce: bool = False, conformance: bool = False
) -> tuple[SimNetwork, Engine, Engine]:
    net = SimNetwork(0)
    directory = LocalDirectory(lambda: net.now)
    engines = []
    for side, g in ((Producer(Identity("P"), mode), p), (Consumer(Identity("D"), mode), d)):
        engine = Engine(
            side,
            net.agent(side.identity.agent),
            KvCache.allocate(g),
            directory.view(),
            lambda: net.now,
            coalesce=coalesce,
            conformance=conformance,
        )
        directory.publish(engine.agent, engine.info)
        engines.append(engine)
    return net, engines[0], engines[1]


def _run(net: SimNetwork, engines: tuple[Engine, ...], outputs: list[object], until: int) -> None:
    for _ in range(2000):
        if sum(isinstance(o, Finished) for o in outputs) >= until:
            return
        net.advance(1e-3)
        for engine in engines:
            engine.poll()
            outputs += engine.take_outputs()
    raise AssertionError(f"requests did not end: {outputs}")


@pytest.mark.parametrize("mode", MODES)
def test_p_blocks_bigger_than_d_blocks_are_refused_at_the_handshake(mode: Mode) -> None:
    p_geo = msgspec.structs.replace(SMALL_GEOMETRY, block_size=8, num_blocks=8)
    d_geo = msgspec.structs.replace(SMALL_GEOMETRY, block_size=4, num_blocks=8)
    net, p, d = _engines(mode, p_geo, d_geo)
    blocks = np.array([1, 2], dtype=np.int32)
    p.submit(Admit("r-0000000a", blocks))
    p.submit(PrefillFinished("r-0000000a", blocks))
    d.submit(Admit("r-0000000b", np.array([3, 4, 5, 6], dtype=np.int32), "P", 1, "r-0000000a"))
    outputs: list[object] = []
    _run(net, (p, d), outputs, until=1)
    names = [type(o).__name__ for o in outputs]
    assert names[:2] == ["ReportFailed", "ReleaseBlocks"]  # D's blocks reported invalid
    assert d.counters["handshake_failed"] == 1 and d.counters["posted"] == 0
    assert d.side.counters["handshake_failed"] == 1
    assert "P's blocks of 8 tokens must divide D's blocks of 4 tokens" in d.side.errors[0]


def test_plan_route_says_why_geometries_cannot_pair() -> None:
    p_geo = msgspec.structs.replace(SMALL_GEOMETRY, block_size=8)
    with pytest.raises(ValueError, match="P's blocks of 8 tokens must divide D's blocks of 4"):
        plan_route(p_geo, SMALL_GEOMETRY, local_is_p=True)
    d_rank1 = msgspec.structs.replace(SMALL_GEOMETRY, tp_size=2, tp_rank=1)
    with pytest.raises(
        ValueError, match=r"exchanges KV with peer ranks \[1\] of 2, not with rank 0"
    ):
        plan_route(d_rank1, msgspec.structs.replace(SMALL_GEOMETRY, tp_size=2), local_is_p=False)
    route = plan_route(
        SMALL_MLA_GEOMETRY.for_rank(0),
        msgspec.structs.replace(SMALL_MLA_GEOMETRY, tp_size=2, tp_rank=1),
        local_is_p=False,
    )
    assert route.pairing is None  # replicated KV: rank 1 only hears that the read is done


@pytest.mark.parametrize("mode", MODES)
def test_a_trace_reports_bytes_descriptors_and_the_fabric_s_merging(mode: Mode) -> None:
    net, p, d = _engines(mode, SMALL_GEOMETRY, SMALL_GEOMETRY)
    p_blocks = np.array([4, 5, 6], dtype=np.int32)  # adjacent on both sides: the fabric merges
    p.submit(Admit("r-0000000a", p_blocks))
    p.submit(PrefillFinished("r-0000000a", p_blocks))
    d.submit(Admit("r-0000000b", np.array([10, 11, 12], dtype=np.int32), "P", 1, "r-0000000a"))
    outputs: list[object] = []
    _run(net, (p, d), outputs, until=2)
    traces = {o.request_id: o for o in outputs if isinstance(o, RequestTrace)}
    poster = traces["r-0000000a" if mode == "push" else "r-0000000b"]
    other = traces["r-0000000b" if mode == "push" else "r-0000000a"]
    assert poster.state == other.state == "done"
    assert poster.stats.transfers == 1 and poster.stats.failed == 0
    assert poster.stats.bytes == 3 * p.kv.block_bytes
    assert poster.stats.descriptors == 3 * SMALL_GEOMETRY.num_regions  # a row per block per layer
    assert poster.stats.fabric_descriptors == SMALL_GEOMETRY.num_regions  # merged per layer
    assert other.stats.transfers == 0 and other.stats.bytes == 0
    assert poster.history[-1][1] == "done" and sum(poster.time_in_state_s.values()) > 0


def test_kv_cache_takes_one_buffer_or_one_per_region() -> None:
    g = SMALL_GEOMETRY
    whole = KvCache.allocate(g)
    assert whole.layout.base_addresses[1] - whole.layout.base_addresses[0] == g.region_bytes
    layers = [torch.zeros(g.region_bytes // 2, dtype=torch.float16) for _ in range(g.num_regions)]
    per_layer = KvCache(g, layers)
    assert per_layer.layout.base_addresses == tuple(t.data_ptr() for t in layers)
    per_layer.fill_blocks([3], 7)  # through host views of the tensors' memory
    assert all(int(t.view(torch.uint8)[3 * g.block_len]) == 7 for t in layers)
    assert all(int(t.view(torch.uint8)[4 * g.block_len]) == 0 for t in layers)
    with pytest.raises(ValueError, match="3 KV buffers"):
        KvCache(g, [*layers, layers[0]])
    with pytest.raises(
        ValueError, match=f"KV buffer 0 has 8 bytes; the geometry needs {g.kv_bytes}"
    ):
        KvCache(g, [np.zeros(8, dtype=np.uint8)])
    with pytest.raises(TypeError, match="contiguous 1-D numpy uint8"):
        KvCache(g, [np.zeros((2, g.kv_bytes // 2), dtype=np.uint8)])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4)])
def test_hnc_pages_move_head_slices_between_tp_sizes(mode: Mode, p_tp: int, d_tp: int) -> None:
    # vLLM's CPU layout: each head's tokens with K and V side by side; a head run is contiguous.
    geometry = msgspec.structs.replace(SMALL_GEOMETRY, kv_layout="HNC")
    cluster = Cluster(mode, p_tp=p_tp, d_tp=d_tp, geometry=geometry, d_block_size=8)
    prs = [cluster.admit(f"r{i}", 5, d_cached=i % 2) for i in range(4)]
    for pr in prs:
        cluster.finish_prefill(pr.key)
    _settle(cluster)
    assert all(set(pr.final.values()) == {"done"} for pr in prs)
    assert cluster.ledger.verified_bytes > 0


@pytest.mark.parametrize("mode", MODES)
def test_coalescing_posts_one_row_per_run_adjacent_on_both_sides(mode: Mode) -> None:
    net, p, d = _engines(mode, SMALL_GEOMETRY, SMALL_GEOMETRY, coalesce=True)
    p_blocks = np.array([4, 5, 6, 9], dtype=np.int32)  # runs 4-6 and 9 on P
    d_blocks = np.array([10, 11, 12, 13], dtype=np.int32)  # one run on D
    for i, block in enumerate(p_blocks):
        p.kv.fill_blocks([int(block)], 0x21 + i)
    p.submit(Admit("r-0000000a", p_blocks))
    p.submit(PrefillFinished("r-0000000a", p_blocks))
    d.submit(Admit("r-0000000b", d_blocks, "P", 1, "r-0000000a"))
    outputs: list[object] = []
    _run(net, (p, d), outputs, until=2)
    traces = {o.request_id: o for o in outputs if isinstance(o, RequestTrace)}
    poster = traces["r-0000000a" if mode == "push" else "r-0000000b"]
    assert poster.state == "done" and poster.stats.bytes == 4 * p.kv.block_bytes
    # Two runs per layer region, merged by kvfsm; the fabric's dynamic path merges nothing more.
    assert poster.stats.descriptors == 2 * SMALL_GEOMETRY.num_regions
    assert poster.stats.fabric_descriptors == 2 * SMALL_GEOMETRY.num_regions
    for p_region, d_region in zip(p.kv.regions(), d.kv.regions(), strict=True):
        p_view = p_region.reshape(SMALL_GEOMETRY.num_blocks, -1)
        d_view = d_region.reshape(SMALL_GEOMETRY.num_blocks, -1)
        np.testing.assert_array_equal(d_view[d_blocks], p_view[p_blocks])
        assert (d_view[d_blocks] != 0).all()  # the filled bytes, not two zeroed caches


@pytest.mark.parametrize("mode", MODES)
def test_fabric_errors_in_telemetry_and_release_are_counted_not_raised(
    mode: Mode, monkeypatch: pytest.MonkeyPatch
) -> None:
    net, p, d = _engines(mode, SMALL_GEOMETRY, SMALL_GEOMETRY)
    poster = p if mode == "push" else d

    def broken(_handle: object) -> None:
        raise FabricError("the agent refused")

    monkeypatch.setattr(poster.fabric, "xfer_telemetry", broken)
    monkeypatch.setattr(poster.fabric, "release_xfer_handle", broken)
    blocks = np.array([4, 5], dtype=np.int32)
    p.submit(Admit("r-0000000a", blocks))
    p.submit(PrefillFinished("r-0000000a", blocks))
    d.submit(Admit("r-0000000b", np.array([7, 8], dtype=np.int32), "P", 1, "r-0000000a"))
    outputs: list[object] = []
    _run(net, (p, d), outputs, until=2)
    assert {o.state for o in outputs if isinstance(o, Finished)} == {"done"}
    assert poster.counters["telemetry_error"] == 1 and poster.counters["release_error"] == 1
    assert not poster.inflight  # the transfer ended despite the errors


def test_a_non_fabric_error_in_cleanup_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not tolerated as a fabric error: reported as a bug (`InternalError`) and counted, and the
    request it hit is abandoned safely."""
    net, p, d = _engines("push", SMALL_GEOMETRY, SMALL_GEOMETRY)

    def bug(_handle: object) -> None:
        raise KeyError("a bug, not the fabric")

    monkeypatch.setattr(p.fabric, "release_xfer_handle", bug)
    blocks = np.array([4], dtype=np.int32)
    p.submit(Admit("r-0000000a", blocks))
    p.submit(PrefillFinished("r-0000000a", blocks))
    d.submit(Admit("r-0000000b", np.array([7], dtype=np.int32), "P", 1, "r-0000000a"))
    outputs: list[object] = []
    _run(net, (p, d), outputs, until=2)
    errors = [o for o in outputs if isinstance(o, InternalError)]
    assert errors and "a bug, not the fabric" in errors[0].trace
    assert p.counters["release_error"] == 0 and p.counters["internal_error"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_conformance_at_run_time_checks_every_step_and_reports_a_divergence(mode: Mode) -> None:
    """`Engine(conformance=True)` replays the core's steps through `transitions`: a clean
    lifecycle diverges nowhere; a core whose table drifted from its model is reported."""
    net, p, d = _engines(mode, SMALL_GEOMETRY, SMALL_GEOMETRY, conformance=True)
    assert p.conformance is not None and d.conformance is not None
    blocks = np.array([4], dtype=np.int32)
    outputs: list[object] = []

    def serve(n: int) -> None:
        rid = f"r{n}-0000000{n}"
        p.submit(Admit(rid, blocks))
        p.submit(PrefillFinished(rid, blocks))
        d.submit(Admit(f"r{n}-0000000{n + 1}", np.array([7], dtype=np.int32), "P", 1, rid))
        _run(net, (p, d), outputs, until=2 * n)

    serve(1)
    assert p.conformance.steps > 3 and d.conformance.steps > 3
    assert p.conformance.divergences == d.conformance.divergences == 0
    # The drift: P's table loses a command the model has on admission (its lease's timer).
    dispatcher = p.side._req
    key = ("allocated", "prefill_finished")
    guards, dest, _, _, terminal = dispatcher._names[key][-1]
    dispatcher._names = {
        **dispatcher._names,
        key: (*dispatcher._names[key][:-1], (guards, dest, (), (), terminal)),
    }
    dispatcher._table.clear()
    serve(2)
    assert p.conformance.divergences >= 1 and p.counters["conformance_divergence"] >= 1
    errors = [o for o in outputs if isinstance(o, InternalError)]
    assert errors and errors[0].detail.startswith("conformance: producer_")
    assert "transitions takes" in errors[0].detail
