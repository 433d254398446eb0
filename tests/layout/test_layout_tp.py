"""Heterogeneous TP: partners and head-slice offsets/lengths by hand, MLA, compatibility."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvfsm.layout import (
    KvGeometry,
    RegionLayout,
    check_compatible,
    coalesce,
    local_descriptors,
    partner_ranks,
    plan_pairings,
    remote_descriptors,
)

# 4 heads of 2 dims, fp16, 2 tokens per block: one head in one block is 2*2*2 = 8 bytes.
# Per rank: TP1 4 heads (segment 32, joint block 64), TP2 2 heads (16 / 32), TP4 1 head (8 / 16).
_MODEL: dict[str, Any] = dict(
    num_layers=1, num_kv_heads=4, head_dim=2, dtype_bytes=2, block_size=2, num_blocks=2
)


def _geo(tp: int, rank: int = 0, **more: Any) -> KvGeometry:
    return KvGeometry(**{**_MODEL, **more}, tp_size=tp, tp_rank=rank)


def test_partner_ranks() -> None:
    assert partner_ranks(1, 2, 1) == (0,)
    assert partner_ranks(3, 4, 2) == (1,)
    assert partner_ranks(0, 1, 2) == (0, 1)
    assert partner_ranks(1, 2, 4) == (2, 3)
    assert partner_ranks(0, 2, 3) == (0, 1)  # sizes need not divide: overlapping ranges pair
    assert partner_ranks(1, 2, 3) == (1, 2)
    assert partner_ranks(2, 3, 3) == (2,)


def test_tp_1_to_2_reader_takes_a_head_slice_of_the_writer() -> None:
    d1, p = _geo(2, 1), _geo(1)  # D rank 1 holds heads 2..3 of P rank 0's 0..3
    (pairing,) = plan_pairings(d1, p).pairings
    assert (pairing.remote_rank, pairing.first_head, pairing.num_heads) == (0, 2, 2)
    assert pairing.remote_span == (16, 16) and pairing.local_span == (0, 16)
    # P block b: K heads at b*64 + [0, 32), V at b*64 + [32, 64); D rank 1 reads heads 2..3.
    remote = remote_descriptors(d1, RegionLayout(p, (0,)))
    np.testing.assert_array_equal(remote[:, :2], [[16, 16], [80, 16], [48, 16], [112, 16]])
    local = local_descriptors(RegionLayout(d1, (10_000,)), p)
    np.testing.assert_array_equal(
        local[:, :2], [[10_000, 16], [10_032, 16], [10_016, 16], [10_048, 16]]
    )
    (d0_pairing,) = plan_pairings(_geo(2, 0), p).pairings
    assert d0_pairing.remote_span == (0, 16)


def test_tp_2_to_1_reader_gathers_from_two_writers() -> None:
    d, p = _geo(1), _geo(2)
    plan = plan_pairings(d, p)
    assert plan.remote_ranks == (0, 1) and plan.notify_only == ()
    first, second = plan.pairings
    assert first.local_span == (0, 16) and first.remote_span == (0, 16)
    assert second.local_span == (16, 16) and second.remote_span == (0, 16)
    # P rank 1's whole K and V segments land in heads 2..3 of D's K and V segments.
    local = second.local_descriptors(RegionLayout(d, (10_000,)))
    np.testing.assert_array_equal(
        local[:, :2], [[10_016, 16], [10_080, 16], [10_048, 16], [10_112, 16]]
    )
    remote = second.remote_descriptors(RegionLayout(p.for_rank(1), (0,)))
    np.testing.assert_array_equal(remote[:, :2], [[0, 16], [32, 16], [16, 16], [48, 16]])


def test_tp_2_to_4() -> None:
    d3, p = _geo(4, 3), _geo(2)
    (pairing,) = plan_pairings(d3, p).pairings
    assert pairing.remote_rank == 1 and pairing.first_head == 3
    assert pairing.remote_span == (8, 8) and pairing.local_span == (0, 8)
    remote = remote_descriptors(d3, RegionLayout(p.for_rank(1), (0,)))
    np.testing.assert_array_equal(remote[:, :2], [[8, 8], [40, 8], [24, 8], [56, 8]])
    (d2_pairing,) = plan_pairings(_geo(4, 2), p).pairings
    assert d2_pairing.remote_rank == 1 and d2_pairing.remote_span == (0, 8)


def test_tp_4_to_2() -> None:
    d1, p = _geo(2, 1), _geo(4)
    plan = plan_pairings(d1, p)
    assert plan.remote_ranks == (2, 3)
    assert [(x.local_span, x.remote_span) for x in plan.pairings] == [
        ((0, 8), (0, 8)),
        ((8, 8), (0, 8)),
    ]
    local = local_descriptors(RegionLayout(d1, (0,)), p.for_rank(3))
    np.testing.assert_array_equal(local[:, :2], [[8, 8], [40, 8], [24, 8], [56, 8]])


def test_equal_tp_moves_whole_blocks_that_coalesce() -> None:
    d, p = _geo(2, 1, num_blocks=4), _geo(2, 1, num_blocks=4)
    (pairing,) = plan_pairings(d, p).pairings
    assert not pairing.local.split_segments
    local = pairing.local_descriptors(RegionLayout(d, (0,)))
    remote = pairing.remote_descriptors(RegionLayout(p, (1000,)))
    lids, rids = pairing.transfer_ids([0, 1, 2], [1, 2, 3])
    out = coalesce(local[lids], remote[rids])
    np.testing.assert_array_equal(out.local, [[0, 96, 0]])
    np.testing.assert_array_equal(out.remote, [[1032, 96, 0]])


def test_mla_reads_one_replica_and_notifies_the_rest() -> None:
    mla: dict[str, Any] = dict(num_kv_heads=1, head_dim=8, mla=True)
    # D TP4 <- P TP2: each D rank reads whole blocks of its one partner.
    plan = plan_pairings(_geo(4, 3, **mla), _geo(2, **mla))
    assert plan.remote_ranks == (1,) and plan.notify_only == ()
    (pairing,) = plan.pairings
    assert pairing.local_span == pairing.remote_span == (0, 32)  # 1 head * 2 tokens * 8 * 2
    rows = pairing.remote_descriptors(RegionLayout(_geo(2, 1, **mla), (500,)))
    np.testing.assert_array_equal(rows[:, :2], [[500, 32], [532, 32]])
    # D TP1 <- P TP2: both P ranks hold everything; read rank 0 % 2 = 0, notify rank 1.
    plan = plan_pairings(_geo(1, **mla), _geo(2, **mla))
    assert (plan.remote_ranks, plan.notify_only, plan.partners) == ((0,), (1,), (0, 1))
    # D TP2 <- P TP4: D rank 1 partners 2, 3; reads 2 + 1 % 2 = 3.
    plan = plan_pairings(_geo(2, 1, **mla), _geo(4, **mla))
    assert (plan.remote_ranks, plan.notify_only) == ((3,), (2,))
    with pytest.raises(ValueError, match="moves no data with remote rank 2/4"):
        remote_descriptors(_geo(2, 1, **mla), RegionLayout(_geo(4, 2, **mla), (0,)))


def test_joint_pairs_with_split() -> None:
    # D registers K and V apart, P jointly: P's blocks are cut into K and V planes to match.
    d, p = _geo(1, split_kv=True), _geo(1)
    (pairing,) = plan_pairings(d, p).pairings
    remote = pairing.remote_descriptors(RegionLayout(p, (0,)))
    np.testing.assert_array_equal(remote[:, :2], [[0, 32], [64, 32], [32, 32], [96, 32]])
    local = pairing.local_descriptors(RegionLayout(d, (1000, 2000)))
    np.testing.assert_array_equal(local[:, :2], [[1000, 32], [1032, 32], [2000, 32], [2032, 32]])


def test_incompatible_geometries_list_every_difference() -> None:
    with pytest.raises(ValueError, match="incompatible KV geometries") as info:
        check_compatible(_geo(1), _geo(1, head_dim=4, num_layers=2))
    assert "head_dim differs: 2 (local) vs 4 (remote)" in str(info.value)
    assert "num_layers differs" in str(info.value)
    with pytest.raises(ValueError, match="mla differs"):
        plan_pairings(_geo(1, num_kv_heads=1, mla=True), _geo(1, num_kv_heads=1))


def test_planned_geometry_must_match_the_advertised_one() -> None:
    d, p = _geo(2, 0), _geo(1)
    (pairing,) = plan_pairings(d, p).pairings
    with pytest.raises(ValueError, match="is not the planned"):
        pairing.remote_descriptors(RegionLayout(_geo(1, num_blocks=3), (0,)))
    with pytest.raises(ValueError, match="moves no data with remote rank 1/2"):
        remote_descriptors(_geo(4, 0), RegionLayout(_geo(2, 1), (0,)))


def test_mla_push_writer_serves_every_reader_that_chose_it() -> None:
    mla: dict[str, Any] = dict(num_kv_heads=1, head_dim=8, mla=True)
    # P TP2 -> D TP4: D ranks 0 and 1 both take their copy from P rank 0, so P rank 0 writes both.
    plan = plan_pairings(_geo(2, 0, **mla), _geo(4, **mla), local_receives=False)
    assert (plan.remote_ranks, plan.notify_only) == ((0, 1), ())
    # P TP4 -> D TP2: D rank 1 takes its copy from P rank 3 (1 % 2 picks the second partner);
    # P rank 2 writes nothing and only notifies D rank 1.
    plan = plan_pairings(_geo(4, 2, **mla), _geo(2, **mla), local_receives=False)
    assert (plan.pairings, plan.notify_only, plan.partners) == ((), (1,), (1,))
    plan = plan_pairings(_geo(4, 3, **mla), _geo(2, **mla), local_receives=False)
    assert plan.remote_ranks == (1,)
    # Non-MLA plans do not depend on the direction.
    assert plan_pairings(_geo(4, 3), _geo(2), local_receives=False) == plan_pairings(
        _geo(4, 3), _geo(2)
    )


def test_transfer_ids_with_block_ratio_and_a_layer_subset() -> None:
    # D blocks of 4 tokens, P blocks of 2 (k=2), 2 layers, TP 1 -> 2 (D rank 0: heads 0..1).
    d, p = _geo(2, 0, num_layers=2, block_size=4), _geo(1, num_layers=2)
    (pairing,) = plan_pairings(d, p).pairings
    assert pairing.local.subdivide == 2 and pairing.remote.subdivide == 1
    assert pairing.local.per_head and pairing.remote.per_head  # heads-first pages, head by head
    # D block 1 -> sub-blocks 2, 3; P sent blocks 0, 1. Planes per layer: K h0, K h1, V h0, V h1.
    # D: 2 blocks * 2 = 4 rows per plane; P: 2 rows per plane. Layer 1 = planes 4..7.
    lids, rids = pairing.transfer_ids([1], [0, 1], layers=[1])
    assert lids.tolist() == [p * 4 + u for p in range(4, 8) for u in (2, 3)]
    assert rids.tolist() == [p * 2 + u for p in range(4, 8) for u in (0, 1)]
    # D block 1 at 1000 + 64: K then V (32 bytes each), each 2 heads of 4 tokens (16 bytes); a
    # sub-block is the first or the second half (8 bytes) of each head's tokens.
    local = pairing.local_descriptors(RegionLayout(d, (0, 1000)))
    np.testing.assert_array_equal(local[lids, 0], [1064, 1072, 1080, 1088, 1096, 1104, 1112, 1120])
    assert set(local[lids, 1]) == {8}
    # P blocks of 64 bytes: K then V, each 4 heads of 2 tokens (8 bytes); heads 0 and 1 go.
    remote = pairing.remote_descriptors(RegionLayout(p, (0, 1000)))
    np.testing.assert_array_equal(remote[rids, 0], [1000, 1064, 1008, 1072, 1032, 1096, 1040, 1104])
    assert set(remote[rids, 1]) == {8}


def test_nhd_pages_move_whole_blocks_only() -> None:
    # Tokens-first pages (vLLM's CPU layout) keep a head's bytes apart: equal TP works, a head
    # slice does not, and the two sides must agree on the page layout.
    (pairing,) = plan_pairings(_geo(2, 1, kv_layout="NHD"), _geo(2, kv_layout="NHD")).pairings
    assert pairing.local_span == (0, 16) and pairing.remote_rank == 1
    with pytest.raises(ValueError, match=r"needs a heads-first page layout \(HND or HNC\)"):
        plan_pairings(_geo(2, kv_layout="NHD"), _geo(1, kv_layout="NHD"))
    with pytest.raises(ValueError, match=r"kv_layout differs: 'NHD' \(local\) vs 'HND'"):
        check_compatible(_geo(1, kv_layout="NHD"), _geo(1))
    with pytest.raises(
        ValueError, match="kv_layout must be 'HND', 'NHD', 'HNC' or 'NHC', got 'XYZ'"
    ):
        _geo(1, kv_layout="XYZ")


def test_the_seed_s_worked_example_of_four_d_workers_reading_two_p_workers() -> None:
    # vLLM's docstring (D world 4, P world 2, HND, not MLA): D workers 0 and 1 read the first and
    # second half of P worker 0's heads, D workers 2 and 3 those of P worker 1.
    # A P rank holds 2 of the 4 heads, 8 bytes each per segment of a block; a D rank holds 1.
    expected = {0: (0, (0, 8)), 1: (0, (8, 8)), 2: (1, (0, 8)), 3: (1, (8, 8))}
    for d_rank, (p_rank, span) in expected.items():
        (pairing,) = plan_pairings(_geo(4, d_rank), _geo(2)).pairings
        assert (pairing.remote_rank, pairing.remote_span) == (p_rank, span)
        assert pairing.local_span == (0, 8)  # all of the D rank's one head
    # ... and with MLA the offset is always 0: the whole cache is shared.
    mla: dict[str, Any] = dict(num_kv_heads=1, head_dim=8, mla=True)
    for d_rank in range(4):
        (pairing,) = plan_pairings(_geo(4, d_rank, **mla), _geo(2, **mla)).pairings
        assert pairing.remote_span == pairing.local_span == (0, 32)
