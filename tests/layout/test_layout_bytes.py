"""End to end over simulated memory: every head of every token lands where the receiver expects.

Each P rank's KV cache is filled with tags naming (layer, K/V, model-wide head, token, dim); the
planned descriptors, picked by `transfer_ids` and merged by `coalesce`, are copied byte for byte
(READ from D's side in pull mode, WRITE from P's side in push mode); then every D rank must hold
exactly the tags of its own heads, in its own block layout.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from kvfsm.layout import (
    KvGeometry,
    RegionLayout,
    block_size_factors,
    coalesce,
    logical_to_kernel,
    plan_pairings,
)

_HEAD_DIM = 2
_LAYERS = 2
_TOKENS = 11  # not a multiple of any block size: the last blocks are partly filled


class _Memory:
    """One flat address space of uint32 elements; addresses are byte offsets into it."""

    def __init__(self) -> None:
        self.data = np.zeros(1 << 16, dtype=np.uint32)
        self.top = 64  # leave a gap at 0 so an address of 0 would be a visible bug

    def place(self, g: KvGeometry) -> RegionLayout:
        if g.interleaved:  # every layer's page of a block together: one span
            bases = [self.top + i * g.block_len for i in range(g.num_regions)]
            self.top += g.kv_bytes + 32
            assert self.top < self.data.nbytes
            return RegionLayout(g, tuple(bases))
        bases = []
        for _ in range(g.num_regions):
            bases.append(self.top)
            self.top += g.region_bytes + 32  # a gap between regions: no accidental merging
        assert self.top < self.data.nbytes
        return RegionLayout(g, tuple(bases))

    def copy(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> None:
        raw = self.data.view(np.uint8)
        for (d, n, _), (s, m, _) in zip(dst, src, strict=True):
            assert n == m
            raw[d : d + n] = raw[s : s + n]


def _element(
    layout: RegionLayout, k: int, unit: int, layer: int, kv: int, head: int, slot: int, dim: int
) -> int:
    """Index (in uint32s) of one element, `unit` being sub-block `unit % k` of block
    `unit // k` (its tokens are the block's `[i, i + 1) * block_size / k`)."""
    g = layout.geometry
    region, seg = (layer * 2 + kv, 0) if g.split_kv else (layer, kv)
    block, token = unit // k, (unit % k) * (g.block_size // k) + slot
    heads = g.heads_per_rank
    block_start = layout.base_addresses[region] + block * g.block_stride
    if g.kv_layout == "NHC":  # tokens, then heads, then each head's K and V side by side
        inner = ((token * heads + head) * g.values_per_token + kv) * g.head_dim + dim
    elif g.kv_layout == "HNC":  # heads, then tokens, then the token's K and V side by side
        inner = ((head * g.block_size + token) * g.values_per_token + kv) * g.head_dim + dim
    elif g.kv_layout == "NHD":  # per K/V segment: tokens, then heads
        inner = seg * g.segment_len // g.dtype_bytes + (token * heads + head) * g.head_dim + dim
    else:  # HND, per K/V segment: heads, then tokens
        inner = seg * g.segment_len // g.dtype_bytes + (head * g.block_size + token) * g.head_dim
        inner += dim
    return (block_start + inner * g.dtype_bytes) // 4


def _tag(layer: int, kv: int, head: int, token: int, dim: int) -> int:
    return 1 + (((layer * 2 + kv) * 64 + head) * 64 + token) * _HEAD_DIM + dim


def _cells(layout: RegionLayout, k: int, units: npt.NDArray[np.int64], small_bs: int) -> Any:
    """(element index, expected tag) of every cell of the request this rank holds."""
    g = layout.geometry
    kvs = (0,) if g.mla else (0, 1)
    for layer, kv, h, token, dim in itertools.product(
        range(g.num_layers), kvs, range(g.heads_per_rank), range(_TOKENS), range(g.head_dim)
    ):
        unit, slot = units[token // small_bs], token % small_bs
        yield (
            _element(layout, k, unit, layer, kv, h, slot, dim),
            _tag(layer, kv, g.first_head + h, token, dim),
        )


def _run(
    p_tp: int,
    d_tp: int,
    p_bs: int,
    d_bs: int,
    p_split: bool,
    d_split: bool,
    mla: bool,
    pull: bool,
    kv_layout: str = "HND",
    interleaved: tuple[bool, bool] = (False, False),
) -> int:
    heads = 1 if mla else 12
    common: dict[str, Any] = dict(
        num_layers=_LAYERS,
        num_kv_heads=heads,
        head_dim=_HEAD_DIM,
        dtype_bytes=4,
        mla=mla,
        kv_layout=kv_layout,
    )
    p_geo = KvGeometry(
        **common,
        block_size=p_bs,
        num_blocks=8,
        tp_size=p_tp,
        split_kv=p_split,
        interleaved=interleaved[0],
    )
    d_geo = KvGeometry(
        **common,
        block_size=d_bs,
        num_blocks=9,
        tp_size=d_tp,
        split_kv=d_split,
        interleaved=interleaved[1],
    )
    mem = _Memory()
    p_layouts = [mem.place(p_geo.for_rank(r)) for r in range(p_tp)]
    d_layouts = [mem.place(d_geo.for_rank(r)) for r in range(d_tp)]
    d_k, p_k = block_size_factors(d_bs, p_bs)
    small = min(p_bs, d_bs)
    rng = np.random.default_rng(p_tp * 100 + d_tp)
    p_blocks = rng.permutation(8)[: -(-_TOKENS // p_bs)]
    d_blocks = rng.permutation(9)[: -(-_TOKENS // d_bs)]
    p_units, d_units = logical_to_kernel(p_blocks, p_k), logical_to_kernel(d_blocks, d_k)
    for layout in p_layouts:
        for index, tag in _cells(layout, p_k, p_units, small):
            mem.data[index] = tag
    descriptors = 0
    if pull:  # each D rank reads
        for d in d_layouts:
            for pairing in plan_pairings(d.geometry, p_geo).pairings:
                lids, rids = pairing.transfer_ids(d_blocks, p_blocks)
                local = pairing.local_descriptors(d)[lids]
                remote = pairing.remote_descriptors(p_layouts[pairing.remote_rank])[rids]
                out = coalesce(local, remote)
                mem.copy(out.local, out.remote)
                descriptors += out.after
    else:  # each P rank writes
        for p in p_layouts:
            for pairing in plan_pairings(p.geometry, d_geo, local_receives=False).pairings:
                lids, rids = pairing.transfer_ids(p_blocks, d_blocks)
                local = pairing.local_descriptors(p)[lids]
                remote = pairing.remote_descriptors(d_layouts[pairing.remote_rank])[rids]
                out = coalesce(local, remote)
                mem.copy(out.remote, out.local)
                descriptors += out.after
    for layout in d_layouts:
        cells = list(_cells(layout, d_k, d_units, small))
        got = mem.data[[i for i, _ in cells]]
        np.testing.assert_array_equal(
            got, [t for _, t in cells], err_msg=f"D rank {layout.geometry.tp_rank}"
        )
    return descriptors


_TP = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (2, 3), (3, 2), (1, 4)]
_BLOCKS = [(2, 2), (2, 4), (4, 2)]
_KV = [(False, False), (True, True), (False, True), (True, False)]


@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
@pytest.mark.parametrize(
    ("p_split", "d_split"), _KV, ids=["joint", "split", "P-joint-D-split", "P-split-D-joint"]
)
@pytest.mark.parametrize(("p_bs", "d_bs"), _BLOCKS, ids=lambda v: str(v))
@pytest.mark.parametrize(("p_tp", "d_tp"), _TP, ids=lambda v: str(v))
def test_every_head_lands_in_place(
    p_tp: int, d_tp: int, p_bs: int, d_bs: int, p_split: bool, d_split: bool, pull: bool
) -> None:
    _run(p_tp, d_tp, p_bs, d_bs, p_split, d_split, mla=False, pull=pull)


@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
@pytest.mark.parametrize(("p_bs", "d_bs"), _BLOCKS, ids=lambda v: str(v))
@pytest.mark.parametrize(("p_tp", "d_tp"), _TP, ids=lambda v: str(v))
def test_mla_replica_lands_on_every_rank(
    p_tp: int, d_tp: int, p_bs: int, d_bs: int, pull: bool
) -> None:
    _run(p_tp, d_tp, p_bs, d_bs, False, False, mla=True, pull=pull)


@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
@pytest.mark.parametrize(("p_bs", "d_bs"), _BLOCKS, ids=lambda v: str(v))
@pytest.mark.parametrize(("p_tp", "d_tp"), _TP, ids=lambda v: str(v))
def test_hnc_pages_land_in_place(p_tp: int, d_tp: int, p_bs: int, d_bs: int, pull: bool) -> None:
    # vLLM's LBHNC block interior: each head's tokens, each token's K and V side by side.
    _run(p_tp, d_tp, p_bs, d_bs, False, False, mla=False, pull=pull, kv_layout="HNC")


@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
@pytest.mark.parametrize(("p_bs", "d_bs"), _BLOCKS, ids=lambda v: str(v))
@pytest.mark.parametrize(("p_tp", "d_tp"), _TP, ids=lambda v: str(v))
def test_nhc_pages_land_in_place(p_tp: int, d_tp: int, p_bs: int, d_bs: int, pull: bool) -> None:
    # vLLM's LBNHC block interior: tokens, each token's heads, each head's K and V side by
    # side. Head slices (TP sizes differ) move one run per token.
    _run(p_tp, d_tp, p_bs, d_bs, False, False, mla=False, pull=pull, kv_layout="NHC")


_INTERLEAVED = [(True, True), (True, False), (False, True)]


@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
@pytest.mark.parametrize("interleaved", _INTERLEAVED, ids=["both", "P", "D"])
@pytest.mark.parametrize("kv_layout", ["HNC", "NHC"])
@pytest.mark.parametrize(("p_bs", "d_bs"), _BLOCKS, ids=lambda v: str(v))
@pytest.mark.parametrize(("p_tp", "d_tp"), _TP[:5], ids=lambda v: str(v))
def test_interleaved_layers_land_in_place(
    p_tp: int,
    d_tp: int,
    p_bs: int,
    d_bs: int,
    kv_layout: str,
    interleaved: tuple[bool, bool],
    pull: bool,
) -> None:
    # vLLM's BLHNC and BLNHC: a block of every layer's pages together, beside LBHNC/LBNHC peers.
    _run(p_tp, d_tp, p_bs, d_bs, False, False, False, pull, kv_layout, interleaved)


def test_interleaved_whole_blocks_move_one_row_per_block() -> None:
    # Equal TP and block size, both sides interleaved: one row per block over all layers,
    # num_layers times fewer than per layer (before merging adjacent ones).
    d = KvGeometry(
        num_layers=4,
        num_kv_heads=2,
        head_dim=2,
        dtype_bytes=2,
        block_size=4,
        num_blocks=8,
        kv_layout="HNC",
        interleaved=True,
    )
    (pairing,) = plan_pairings(d, d).pairings
    assert pairing.local.fuse_layers and pairing.remote.fuse_layers
    lids, rids = pairing.transfer_ids([5, 2, 7], [1, 2, 3])
    assert lids.tolist() == [5, 2, 7] and rids.tolist() == [1, 2, 3]
    layout = RegionLayout(d, tuple(4096 + i * d.block_len for i in range(4)))
    rows = pairing.local_descriptors(layout)
    assert rows[5].tolist() == [4096 + 5 * d.block_stride, 4 * d.block_len, 0]
    flat = msgspec.structs.replace(d, interleaved=False)
    (per_layer,) = plan_pairings(d, flat).pairings
    assert len(per_layer.transfer_ids([5, 2, 7], [1, 2, 3])[0]) == 4 * 3


def test_equal_geometry_coalesces_to_few_descriptors() -> None:
    # Homogeneous TP, same block size, joint: whole-block rows, merged where blocks are adjacent.
    # With random block ids few are adjacent, but never more rows than blocks x layers.
    assert _run(2, 2, 2, 2, False, False, mla=False, pull=True) <= 2 * _LAYERS * -(-_TOKENS // 2)
