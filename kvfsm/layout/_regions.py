"""Registered KV regions of one rank, and the descriptor lists cut from them.

A descriptor list is a table of rows (addr, len, dev), grouped in *planes* of equal length: one
plane per region (or per K/V segment of a region), one row per block (or per sub-block), so that
`plane * rows_per_plane + block` is a row's index. Both sides of a transfer cut their lists the
same way, which makes the row ids of a request computable by broadcasting alone.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from kvfsm.layout._geometry import KvGeometry
from kvfsm.layout._ids import Int64Array, as_ids, id_bounds, positive_int

__all__ = ["BlockSlice", "RegionLayout", "SliceRows", "slice_ids", "slice_rows"]


class BlockSlice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which bytes of every block a descriptor list covers (the whole block by default).

    * `subdivide` k: each block is cut into k sub-blocks of `block_size / k` tokens, sub-block
      `b * k + i` holding tokens `[i, i + 1) * block_size / k` of block `b`; rows then number
      `num_blocks * k` per plane. Where a page keeps each head's tokens together (HND, HNC), a
      sub-block is one run per head: it needs `per_head`. Where tokens come first, it is one run
      per K/V segment.
    * `first_head`, `num_heads`: only these of the rank's heads (index within the rank; None:
      all from `first_head`), one contiguous range per K/V segment.
    * `split_segments`: one plane per K/V segment of a joint region, so K and V rows are separate
      (needed for a head slice, and to pair with a peer that registers K and V apart).
    * `per_head`: one plane per head (and K/V segment, segments first): a peer whose blocks hold
      another number of tokens pairs with this side head by head.
    * `fuse_layers`: with interleaved layers, one row per whole block of every layer (one plane
      in all): `num_layers` times fewer rows, for a peer whose blocks are laid out alike.
    """

    subdivide: int = 1
    first_head: int = 0
    num_heads: int | None = None
    split_segments: bool = False
    per_head: bool = False
    fuse_layers: bool = False


class _Cut(NamedTuple):
    """A BlockSlice resolved against a geometry, in bytes: the row of unit `u` in plane `p`
    starts at `base + planes[p] + (u // k) * block_len + (u % k) * sub_stride`."""

    rows_per_plane: int
    k: int
    block_len: int
    sub_stride: int  # between the sub-blocks of one block
    planes: Int64Array  # where each plane of a region starts inside a block
    length: int


def _cut(g: KvGeometry, part: BlockSlice) -> _Cut:
    k = positive_int(part.subdivide, "subdivide")
    if g.block_size % k:
        raise ValueError(f"blocks of {g.block_size} tokens cannot be cut into {k} equal parts")
    n = g.heads_per_rank - part.first_head if part.num_heads is None else part.num_heads
    if part.first_head < 0 or n < 1 or part.first_head + n > g.heads_per_rank:
        raise ValueError(
            f"heads [{part.first_head}, {part.first_head + n}) do not lie within the rank's"
            f" {g.heads_per_rank} heads"
        )
    if n != g.heads_per_rank and g.kv_layout == "NHC" and g.block_size != k:
        # Tokens first: a head slice is one run per token, so the units must be single tokens.
        raise ValueError(
            f"a head slice of NHC blocks is cut per token: subdivide by {g.block_size}"
        )
    if part.fuse_layers and not (g.interleaved and k == 1 and n == g.heads_per_rank):
        raise ValueError("only whole blocks of interleaved layers fuse into one row per block")
    if part.fuse_layers:
        whole = g.block_stride  # every layer's page of the block
        return _Cut(g.num_blocks, 1, whole, whole, np.zeros(1, np.int64), whole)
    segments = np.arange(g.segments_per_block, dtype=np.int64) * g.segment_len
    heads_first = not g.tokens_first
    if part.per_head or (k > 1 and heads_first and g.heads_per_rank > 1):
        if not part.per_head:
            raise ValueError("sub-blocks of heads-first blocks are one run per head: per_head")
        heads = (part.first_head + np.arange(n, dtype=np.int64)) * g.head_bytes
        planes = (segments[:, None] + heads[None, :]).ravel()
        head = g.head_bytes // k
        return _Cut(g.num_blocks * k, k, g.block_stride, head, planes, head)
    if part.split_segments or g.segments_per_block == 1:
        # One run per segment and sub-block: the slice's heads (heads first), or the
        # sub-block's tokens, whole heads or one token's heads of NHC (tokens first).
        sub = g.segment_len // k
        head = g.head_bytes // k if heads_first else sub // g.heads_per_rank
        offset = segments + part.first_head * head
        return _Cut(g.num_blocks * k, k, g.block_stride, sub, offset, n * head)
    if n != g.heads_per_rank:
        # In a joint block the K heads and V heads of a slice are two separate ranges.
        raise ValueError("a head slice of joint K/V blocks needs split_segments=True")
    if k > 1:
        raise ValueError("sub-blocks of joint K/V blocks are one run per segment: split_segments")
    return _Cut(g.num_blocks, 1, g.block_stride, g.block_len, np.zeros(1, np.int64), g.block_len)


class RegionLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rank's geometry plus where its regions live: what a peer needs to address its blocks.

    `base_addresses` has one entry per region, layer-major (L0 K, L0 V, L1 K, ... when K/V are
    split; L0, L1, ... otherwise). Regions must not overlap.
    """

    geometry: KvGeometry
    base_addresses: tuple[int, ...]
    device: int = 0
    """Device id put in every row (NIXL wants >= 0; DRAM uses 0)."""

    def __post_init__(self) -> None:
        g = self.geometry
        if len(self.base_addresses) != g.num_regions:
            split = (
                f"{g.num_layers} layers x 2 regions (K, V)"
                if g.split_kv
                else f"{g.num_layers} layers"
            )
            raise ValueError(
                f"the geometry needs {g.num_regions} base addresses ({split}),"
                f" got {len(self.base_addresses)}"
            )
        if isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < 0:
            raise ValueError(f"device must be an integer >= 0, got {self.device!r}")
        bases = as_ids(np.asarray(self.base_addresses), None, "base addresses")
        if g.interleaved:
            steps = np.diff(bases)
            if steps.size and np.any(steps != g.block_len):
                raise ValueError(
                    f"interleaved regions must lie one page ({g.block_len} bytes) apart, in order"
                )
            return
        ordered = np.sort(bases)
        clash = np.flatnonzero(ordered[1:] < ordered[:-1] + g.region_bytes)
        if clash.size:
            lo, hi = int(ordered[clash[0]]), int(ordered[clash[0] + 1])
            raise ValueError(
                f"regions at {lo:#x} and {hi:#x} overlap: each region is {g.region_bytes} bytes"
            )

    def regions(self) -> Int64Array:
        """Rows (base, bytes, dev) of the memory to register with NIXL: one per region, or one
        span holding every region when they are interleaved."""
        g = self.geometry
        count = 1 if g.interleaved else g.num_regions
        rows = np.empty((count, 3), dtype=np.int64)
        rows[:, 0] = self.base_addresses[:count]
        rows[:, 1] = g.kv_bytes if g.interleaved else g.region_bytes
        rows[:, 2] = self.device
        return rows

    def descriptors(self, part: BlockSlice | None = None) -> Int64Array:
        """Descriptor rows (addr, len, dev) of every block of every region, plane by plane.

        Without `part`, one row per whole block: shape (num_regions * num_blocks, 3), row
        `region * num_blocks + block`. With `part`, the rows of that slice, numbered as
        `slice_ids` says.
        """
        part = part or BlockSlice()
        cut = _cut(self.geometry, part)
        bases = np.asarray(self.base_addresses[: 1 if part.fuse_layers else None], dtype=np.int64)
        plane_start = (bases[:, None] + cut.planes[None, :]).ravel()
        u = np.arange(cut.rows_per_plane, dtype=np.int64)
        units = (u // cut.k) * cut.block_len + (u % cut.k) * cut.sub_stride
        rows = np.empty((plane_start.size * cut.rows_per_plane, 3), dtype=np.int64)
        rows[:, 0] = (plane_start[:, None] + units[None, :]).ravel()
        rows[:, 1] = cut.length
        rows[:, 2] = self.device
        return rows

    def descriptor_ids(
        self, block_ids: npt.ArrayLike, region_subset: npt.ArrayLike | None = None
    ) -> Int64Array:
        """Rows of `descriptors()` holding `block_ids` in each region of `region_subset` (all).

        Region-major: all the blocks (in the order given) of the first region, then of the next.
        """
        g = self.geometry
        blocks = as_ids(block_ids, g.num_blocks, "block ids")
        if region_subset is None:
            regions = np.arange(g.num_regions, dtype=np.int64)
        else:
            regions = as_ids(region_subset, g.num_regions, "region ids")
        return _grid(regions, g.num_blocks, blocks)


class SliceRows(NamedTuple):
    """`slice_ids` for one geometry, slice and set of layers, resolved once: a callable mapping
    unit ids to row ids with one bounds check (for hot paths that map many requests)."""

    plane_starts: Int64Array
    """Shape (planes, 1): the first row of each plane."""
    rows_per_plane: int

    def __call__(self, units: Int64Array) -> Int64Array:
        """Row ids of `units` (1-D int64) in every plane, plane-major; ValueError if a unit is
        out of range."""
        if units.size:
            lo, hi = id_bounds(units)
            if lo < 0 or hi >= self.rows_per_plane:
                raise ValueError(
                    f"block ids must lie in [0, {self.rows_per_plane}), got values from"
                    f" {lo} to {hi}"
                )
        rows: Int64Array = (self.plane_starts + units[None, :]).ravel()
        return rows


def slice_rows(
    geometry: KvGeometry, part: BlockSlice, layers: npt.ArrayLike | None = None
) -> SliceRows:
    """The row mapping of `slice_ids` for `part` of `geometry`'s blocks in `layers` (all)."""
    cut = _cut(geometry, part)
    if part.fuse_layers:  # one plane: every layer's page of a block in one row
        if layers is not None:
            raise ValueError("fused rows cover every layer: no layer subset")
        return SliceRows(np.zeros((1, 1), dtype=np.int64), cut.rows_per_plane)
    if layers is None:
        chosen = np.arange(geometry.num_layers, dtype=np.int64)
    else:
        chosen = as_ids(layers, geometry.num_layers, "layer ids")
    per_layer = geometry.regions_per_layer * cut.planes.size
    planes = (chosen[:, None] * per_layer + np.arange(per_layer, dtype=np.int64)).ravel()
    return SliceRows(planes[:, None] * cut.rows_per_plane, cut.rows_per_plane)


def slice_ids(
    geometry: KvGeometry,
    part: BlockSlice,
    unit_ids: npt.ArrayLike,
    layers: npt.ArrayLike | None = None,
) -> Int64Array:
    """Rows of `RegionLayout.descriptors(part)` holding `unit_ids` in each layer of `layers`.

    `unit_ids` are (sub-)block ids, i.e. kernel block ids when `part.subdivide` > 1. Order:
    plane-major (layer, then region K/V or segment K/V), units in the order given.
    """
    rows = slice_rows(geometry, part, layers)
    return rows(as_ids(unit_ids, rows.rows_per_plane, "block ids"))


def _grid(planes: Int64Array, rows_per_plane: int, units: Int64Array) -> Int64Array:
    # Outer sum instead of a loop: every (plane, unit) pair at once, plane-major.
    ids: Int64Array = (planes[:, None] * rows_per_plane + units[None, :]).ravel()
    return ids
