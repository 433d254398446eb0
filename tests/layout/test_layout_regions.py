"""RegionLayout descriptor rows and ids, computed by hand for tiny geometries."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from kvfsm.layout import BlockSlice, KvGeometry, RegionLayout, id_bounds, slice_ids, slice_rows

# 2 layers, 2 heads of 4 dims, fp16, 2 tokens per block, 3 blocks.
# One head in one block: 2 tokens * 4 dims * 2 bytes = 16 bytes.
_TINY: dict[str, Any] = dict(
    num_layers=2, num_kv_heads=2, head_dim=4, dtype_bytes=2, block_size=2, num_blocks=3
)


def test_joint_rows_by_hand() -> None:
    # Joint: K (2 heads, 32 bytes) then V (32 bytes) per block: block_len 64.
    layout = RegionLayout(KvGeometry(**_TINY), (1000, 2000))
    expected = [
        [1000, 64, 0],
        [1064, 64, 0],
        [1128, 64, 0],  # layer 0, blocks 0..2
        [2000, 64, 0],
        [2064, 64, 0],
        [2128, 64, 0],  # layer 1
    ]
    np.testing.assert_array_equal(layout.descriptors(), expected)
    assert layout.descriptors().dtype == np.int64


def test_split_rows_by_hand() -> None:
    # Split: regions L0K, L0V, L1K, L1V; each block 2 heads * 16 = 32 bytes.
    layout = RegionLayout(KvGeometry(**_TINY, split_kv=True), (1000, 2000, 3000, 4000), device=1)
    rows = layout.descriptors()
    assert rows.shape == (12, 3)
    np.testing.assert_array_equal(rows[:3], [[1000, 32, 1], [1032, 32, 1], [1064, 32, 1]])
    np.testing.assert_array_equal(rows[3:6, 0], [2000, 2032, 2064])
    np.testing.assert_array_equal(rows[9:, 0], [4000, 4032, 4064])
    np.testing.assert_array_equal(
        layout.regions(), [[1000, 96, 1], [2000, 96, 1], [3000, 96, 1], [4000, 96, 1]]
    )


def test_descriptor_ids_for_blocks_3_0_across_two_layers() -> None:
    g = KvGeometry(**{**_TINY, "num_blocks": 4})
    joint = RegionLayout(g, (0, 10_000))
    # Region-major: region 0 holds rows 0..3, region 1 rows 4..7; blocks in the given order.
    np.testing.assert_array_equal(joint.descriptor_ids(np.array([3, 0])), [3, 0, 7, 4])
    split = RegionLayout(msgspec.structs.replace(g, split_kv=True), (0, 10_000, 20_000, 30_000))
    np.testing.assert_array_equal(split.descriptor_ids([3, 0]), [3, 0, 7, 4, 11, 8, 15, 12])
    np.testing.assert_array_equal(split.descriptor_ids([3, 0], region_subset=[2]), [11, 8])
    # The ids pick the rows of those blocks.
    np.testing.assert_array_equal(joint.descriptors()[[3, 0, 7, 4], 0], [192, 0, 10_192, 10_000])


def test_whole_slice_equals_plain_rows_and_slice_ids() -> None:
    layout = RegionLayout(KvGeometry(**_TINY, split_kv=True), (1000, 2000, 3000, 4000))
    np.testing.assert_array_equal(layout.descriptors(BlockSlice()), layout.descriptors())
    np.testing.assert_array_equal(
        slice_ids(layout.geometry, BlockSlice(), [2], layers=[1]),
        layout.descriptor_ids([2], [2, 3]),
    )


def test_split_segments_of_a_joint_region() -> None:
    # Head 1 only, K and V planes apart: K at +16, V at +32+16 in each 64-byte block.
    layout = RegionLayout(KvGeometry(**{**_TINY, "num_layers": 1}), (1000,))
    part = BlockSlice(first_head=1, num_heads=1, split_segments=True)
    np.testing.assert_array_equal(
        layout.descriptors(part)[:, :2],
        [[1016, 16], [1080, 16], [1144, 16], [1048, 16], [1112, 16], [1176, 16]],
    )
    np.testing.assert_array_equal(slice_ids(layout.geometry, part, [2, 0]), [2, 0, 5, 3])
    with pytest.raises(ValueError, match="needs split_segments=True"):
        layout.descriptors(BlockSlice(first_head=1, num_heads=1))
    with pytest.raises(ValueError, match=r"heads \[1, 3\) do not lie within the rank's 2 heads"):
        layout.descriptors(BlockSlice(first_head=1, num_heads=2, split_segments=True))


def test_subdivided_rows_are_one_run_per_head() -> None:
    # 4-token blocks as 2 sub-blocks of 2 tokens: a block is 128 bytes, K then V, each 2 heads
    # of 32 bytes; a sub-block is the first or the second half of each head's: 16-byte runs.
    layout = RegionLayout(KvGeometry(**{**_TINY, "num_layers": 1, "block_size": 4}), (0,))
    rows = layout.descriptors(BlockSlice(subdivide=2, per_head=True))
    assert rows.shape == (4 * 6, 3) and set(rows[:, 1]) == {16}
    np.testing.assert_array_equal(rows[:6, 0], [0, 16, 128, 144, 256, 272])  # K, head 0
    np.testing.assert_array_equal(rows[6:12, 0], [32, 48, 160, 176, 288, 304])  # K, head 1
    np.testing.assert_array_equal(rows[18:, 0], [96, 112, 224, 240, 352, 368])  # V, head 1
    with pytest.raises(ValueError, match="one run per head"):
        layout.descriptors(BlockSlice(subdivide=2))
    with pytest.raises(ValueError, match="cannot be cut into 3 equal parts"):
        layout.descriptors(BlockSlice(subdivide=3, per_head=True))


def test_subdivided_tokens_first_rows_are_one_run_per_segment() -> None:
    # NHD, split K/V: a sub-block is a contiguous half of the block (its first or last tokens).
    g = KvGeometry(**{**_TINY, "num_layers": 1, "block_size": 4, "kv_layout": "NHD"})
    layout = RegionLayout(msgspec.structs.replace(g, split_kv=True), (0, 1000))
    rows = layout.descriptors(BlockSlice(subdivide=2))
    np.testing.assert_array_equal(rows[:6, 0], [0, 32, 64, 96, 128, 160])
    assert set(rows[:, 1]) == {32}


@pytest.mark.parametrize(
    ("blocks", "regions", "message"),
    [
        ([3], None, r"block ids must lie in \[0, 3\), got values from 3 to 3"),
        ([-1, 0], None, "from -1 to 0"),
        ([1.0], None, "block ids must be integers"),
        ([[0]], None, "must be a 1-D array"),
        ([0], [4], r"region ids must lie in \[0, 2\)"),
    ],
)
def test_bad_ids_raise(blocks: object, regions: object, message: str) -> None:
    layout = RegionLayout(KvGeometry(**_TINY), (0, 1000))
    with pytest.raises(ValueError, match=message):
        layout.descriptor_ids(blocks, regions)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1, 64, 65, 5000])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64])
def test_id_bounds_on_few_and_many_ids(size: int, dtype: type) -> None:
    # Few ids take Python's min/max, many numpy's: both must find the same extremes.
    ids: np.ndarray = np.random.default_rng(size).permutation(size).astype(dtype) + 7
    assert id_bounds(ids) == (7, size + 6)
    if dtype is not np.uint64:
        ids[size // 2] = -3
        assert id_bounds(ids)[0] == -3
    else:
        ids[size // 2] = 2**64 - 1  # beyond int64: kept exact, not wrapped
        assert id_bounds(ids)[1] == 2**64 - 1


@pytest.mark.parametrize("size", [3, 100])
def test_slice_rows_refuse_units_out_of_range(size: int) -> None:
    rows = slice_rows(KvGeometry(**(_TINY | {"num_blocks": 200})), BlockSlice())
    units = np.arange(size, dtype=np.int64)
    assert rows(units).shape == (2 * size,)
    units[-1] = 200
    with pytest.raises(ValueError, match=r"must lie in \[0, 200\), got values from 0 to 200"):
        rows(units)
    units[-1], units[0] = 5, -1
    with pytest.raises(ValueError, match="got values from -1 to"):
        rows(units)


def test_empty_block_list_gives_no_ids() -> None:
    layout = RegionLayout(KvGeometry(**_TINY), (0, 1000))
    assert layout.descriptor_ids([]).shape == (0,)


def test_layout_validation() -> None:
    g = KvGeometry(**_TINY, split_kv=True)
    with pytest.raises(ValueError, match=r"needs 4 base addresses \(2 layers x 2 regions"):
        RegionLayout(g, (0, 1000))
    with pytest.raises(ValueError, match="overlap: each region is 96 bytes"):
        RegionLayout(g, (0, 1000, 2000, 2050))
    with pytest.raises(ValueError, match="device must be an integer >= 0"):
        RegionLayout(g, (0, 1000, 2000, 3000), device=-1)


def test_layout_round_trips_through_msgpack() -> None:
    layout = RegionLayout(KvGeometry(**_TINY), (0, 4096), device=2)
    wire = msgspec.msgpack.encode(layout)
    assert msgspec.msgpack.decode(wire, type=RegionLayout) == layout


def test_sixty_four_thousand_ids_by_broadcasting() -> None:
    # 32 layers x K/V = 64 regions, 1000 blocks each: 64,000 ids in one outer sum.
    g = KvGeometry(
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        dtype_bytes=2,
        block_size=16,
        num_blocks=4000,
        split_kv=True,
    )
    bases = tuple(i * g.region_bytes for i in range(g.num_regions))
    layout = RegionLayout(g, bases)
    blocks = np.random.default_rng(0).permutation(g.num_blocks)[:1000]
    ids = layout.descriptor_ids(blocks)
    assert ids.shape == (64_000,)
    assert ids[1000] == 4000 + blocks[0] and ids[-1] == 63 * 4000 + blocks[-1]
    rows = layout.descriptors()[ids]
    assert rows.shape == (64_000, 3)
