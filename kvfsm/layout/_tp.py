"""Heterogeneous tensor parallelism: which remote ranks a local rank exchanges KV with, and which
bytes of each block travel, so that every head lands in the right slice.

TP rank r of T holds the model's heads [r*H/T, (r+1)*H/T). A local rank pairs with every remote
rank whose head range overlaps its own, and exchanges exactly the overlapping heads: when the
local side has more ranks, it takes a head slice of one remote rank's blocks; when fewer, it
takes whole blocks of several remote ranks, each into its slice of the local blocks. The same
rule covers equal TP (one partner, whole blocks) and sizes that do not divide each other.

With MLA every rank holds the whole latent KV, so a receiving rank needs one source: its
partners are the ranks the split rule would pair (as if the KV were split), it takes the data
from one of them (its own rank modulo their count), and the others are only notified so that
their consumer counts hold. A sending rank therefore sends to the partners that chose it (in
push mode every receiver still needs its own copy) and only notifies the rest.

The plan needs only the two geometries (it is known before any handshake); the peer's base
addresses, from its handshake payload, turn a pairing into descriptor rows.
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt

from kvfsm.layout._blocksize import block_size_factors, pair_units
from kvfsm.layout._geometry import KvGeometry
from kvfsm.layout._ids import Int64Array
from kvfsm.layout._regions import BlockSlice, RegionLayout, SliceRows, slice_ids, slice_rows

__all__ = [
    "RankPairing",
    "TpPlan",
    "check_compatible",
    "local_descriptors",
    "partner_ranks",
    "plan_pairings",
    "remote_descriptors",
]

_MUST_MATCH = ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "mla", "kv_layout")


class RankPairing(msgspec.Struct, frozen=True, kw_only=True):
    """One local rank's exchange with one remote rank: heads [first_head, first_head+num_heads).

    `local` and `remote` say which bytes of each side's blocks are cut into rows; they are
    chosen so that row i of the local list and row i of the remote list have equal lengths and
    hold the same heads, tokens and layer.
    """

    local_geometry: KvGeometry
    remote_geometry: KvGeometry
    """The remote engine's geometry at this pairing's remote rank."""
    first_head: int
    """Model-wide index of the first exchanged head (0 with MLA)."""
    num_heads: int
    local: BlockSlice
    remote: BlockSlice
    unit_split: int = 1
    """Rows per unit of the smaller block size: its tokens when a tokens-first (NHC) page is
    cut into head slices (one run per token), else 1. Unit ids pairing the two sides' blocks
    (`align_tail`) expand by it before they select rows."""

    @property
    def remote_rank(self) -> int:
        """The remote TP rank of this pairing."""
        return self.remote_geometry.tp_rank

    @property
    def local_span(self) -> tuple[int, int]:
        """(offset, length) in bytes of the exchanged heads in one local (sub-)block segment."""
        return _span(self.local_geometry, self.local)

    @property
    def remote_span(self) -> tuple[int, int]:
        """(offset, length) in bytes of the exchanged heads in one remote (sub-)block segment."""
        return _span(self.remote_geometry, self.remote)

    def local_descriptors(self, layout: RegionLayout) -> Int64Array:
        """The local descriptor rows of this pairing, cut from the local rank's regions."""
        if layout.geometry != self.local_geometry:
            raise ValueError(
                f"local layout {layout.geometry} is not the planned {self.local_geometry}"
            )
        return layout.descriptors(self.local)

    def remote_descriptors(self, layout: RegionLayout) -> Int64Array:
        """The remote descriptor rows of this pairing, cut from the peer's advertised regions."""
        if layout.geometry != self.remote_geometry:
            raise ValueError(
                f"peer layout {layout.geometry} is not the planned {self.remote_geometry}"
            )
        return layout.descriptors(self.remote)

    def transfer_ids(
        self,
        local_blocks: npt.ArrayLike,
        remote_blocks: npt.ArrayLike,
        layers: npt.ArrayLike | None = None,
    ) -> tuple[Int64Array, Int64Array]:
        """Row ids into the local and remote descriptor lists for a request, paired row for row.

        `local_blocks` and `remote_blocks` are each side's logical block ids in token order; the
        side with bigger blocks expands to kernel blocks first (see `pair_units`).
        """
        local_units, remote_units = pair_units(
            local_blocks, remote_blocks, self.local.subdivide, self.remote.subdivide
        )
        return self.unit_ids(local_units, remote_units, layers)

    def unit_ids(
        self,
        local_units: npt.ArrayLike,
        remote_units: npt.ArrayLike,
        layers: npt.ArrayLike | None = None,
    ) -> tuple[Int64Array, Int64Array]:
        """Row ids into the local and remote descriptor lists for already paired kernel block
        ids (e.g. from `align_tail`), row for row."""
        return (
            slice_ids(self.local_geometry, self.local, local_units, layers),
            slice_ids(self.remote_geometry, self.remote, remote_units, layers),
        )

    def row_maps(self, layers: npt.ArrayLike | None = None) -> tuple[SliceRows, SliceRows]:
        """`unit_ids` resolved once, for the local and the remote side."""
        return (
            slice_rows(self.local_geometry, self.local, layers),
            slice_rows(self.remote_geometry, self.remote, layers),
        )


class TpPlan(msgspec.Struct, frozen=True):
    """A local rank's pairings with one remote engine, plus the ranks it only notifies (MLA)."""

    pairings: tuple[RankPairing, ...]
    notify_only: tuple[int, ...] = ()

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """The remote ranks data moves with, ascending."""
        return tuple(p.remote_rank for p in self.pairings)

    @property
    def partners(self) -> tuple[int, ...]:
        """Every remote rank that expects to hear from this local rank, ascending."""
        return tuple(sorted(self.remote_ranks + self.notify_only))


def check_compatible(local: KvGeometry, remote: KvGeometry) -> None:
    """Raise ValueError listing every way the two engines' KV caches cannot exchange blocks."""
    problems = [
        f"{name} differs: {getattr(local, name)!r} (local) vs {getattr(remote, name)!r} (remote)"
        for name in _MUST_MATCH
        if getattr(local, name) != getattr(remote, name)
    ]
    try:
        block_size_factors(local.block_size, remote.block_size)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ValueError("incompatible KV geometries: " + "; ".join(problems))


def partner_ranks(local_tp_rank: int, local_tp_size: int, remote_tp_size: int) -> tuple[int, ...]:
    """Remote ranks whose share of the model's heads overlaps local rank's, ascending.

    Rank r of T covers [r/T, (r+1)/T) of the heads; two ranks pair when their ranges overlap.
    """
    r = np.arange(remote_tp_size, dtype=np.int64)
    # Cross-multiplied interval overlap test: exact integer arithmetic, no fractions.
    overlap = (local_tp_rank * remote_tp_size < (r + 1) * local_tp_size) & (
        r * local_tp_size < (local_tp_rank + 1) * remote_tp_size
    )
    return tuple(int(x) for x in np.flatnonzero(overlap))


def plan_pairings(local: KvGeometry, remote: KvGeometry, *, local_receives: bool = True) -> TpPlan:
    """How local rank `local.tp_rank` exchanges KV with the remote engine (its tp_rank ignored).

    `local_receives`: the local side is the one the KV lands on (READ in pull mode); False when
    it sends (WRITE in push mode). Only MLA plans depend on it (see the module docstring).
    """
    check_compatible(local, remote)
    local_k, remote_k = block_size_factors(local.block_size, remote.block_size)
    partners = partner_ranks(local.tp_rank, local.tp_size, remote.tp_size)
    chosen = partners
    if local.mla and local_receives:
        chosen = (_mla_source(local.tp_rank, local.tp_size, remote.tp_size),)
    elif local.mla:
        chosen = tuple(
            r for r in partners if _mla_source(r, remote.tp_size, local.tp_size) == local.tp_rank
        )
    return TpPlan(
        tuple(_pairing(local, remote.for_rank(r), local_k, remote_k) for r in chosen),
        tuple(r for r in partners if r not in chosen),
    )


def remote_descriptors(
    local: KvGeometry, peer: RegionLayout, *, local_receives: bool = True
) -> Int64Array:
    """Descriptor rows for reading/writing the peer rank advertised in `peer` (its handshake).

    Raises ValueError when the local rank moves no data with that peer rank.
    """
    return _pairing_with(local, peer.geometry, local_receives).remote_descriptors(peer)


def local_descriptors(
    local: RegionLayout, peer: KvGeometry, *, local_receives: bool = True
) -> Int64Array:
    """The local descriptor rows that pair with `remote_descriptors` of the peer rank `peer`."""
    return _pairing_with(local.geometry, peer, local_receives).local_descriptors(local)


def _mla_source(receiver_rank: int, receiver_tp: int, sender_tp: int) -> int:
    # Spread receivers over their partners; deterministic, so both sides agree without talking.
    partners = partner_ranks(receiver_rank, receiver_tp, sender_tp)
    return partners[receiver_rank % len(partners)]


def _pairing_with(local: KvGeometry, peer: KvGeometry, local_receives: bool) -> RankPairing:
    plan = plan_pairings(local, peer, local_receives=local_receives)
    for pairing in plan.pairings:
        if pairing.remote_rank == peer.tp_rank:
            return pairing
    raise ValueError(
        f"local rank {local.tp_rank}/{local.tp_size} moves no data with remote rank"
        f" {peer.tp_rank}/{peer.tp_size} (it pairs with {list(plan.remote_ranks)})"
    )


def _pairing(local: KvGeometry, remote: KvGeometry, local_k: int, remote_k: int) -> RankPairing:
    if local.mla:
        first, count = 0, local.heads_per_rank
    else:
        first = max(local.first_head, remote.first_head)
        count = (
            min(local.first_head + local.heads_per_rank, remote.first_head + remote.heads_per_rank)
            - first
        )
    whole = count == local.heads_per_rank == remote.heads_per_rank
    if not whole and local.kv_layout == "NHD":
        raise ValueError(
            f"TP {local.tp_size} and {remote.tp_size} exchange slices of heads, which needs a"
            f" heads-first page layout (HND or HNC) on both sides; these use NHD"
        )
    # Whole-block rows only when both sides cut their blocks alike; otherwise every K and V
    # segment gets its own plane, which lines up a joint region with a split one too. Blocks
    # of different sizes pair by sub-blocks: one run per segment, and per head where a page
    # keeps each head's tokens together.
    ratio = local_k > 1 or remote_k > 1
    split = ratio or not (whole and local.split_kv == remote.split_kv)
    per_head = ratio and not local.tokens_first and count > 1
    # Both sides' blocks hold every layer's pages together, alike: one row per block.
    fuse = whole and not split and local.interleaved and remote.interleaved
    # Tokens first (NHC): a head slice is one run per token, so both sides cut to tokens.
    per_token = min(local.block_size, remote.block_size) if local.kv_layout == "NHC" else 1
    per_token = 1 if whole else per_token
    return RankPairing(
        local_geometry=local,
        remote_geometry=remote,
        first_head=first,
        num_heads=count,
        unit_split=per_token,
        local=BlockSlice(
            subdivide=local_k * per_token,
            first_head=first - local.first_head,
            num_heads=count,
            split_segments=split,
            per_head=per_head,
            fuse_layers=fuse,
        ),
        remote=BlockSlice(
            subdivide=remote_k * per_token,
            first_head=first - remote.first_head,
            num_heads=count,
            split_segments=split,
            per_head=per_head,
            fuse_layers=fuse,
        ),
    )


def _span(g: KvGeometry, part: BlockSlice) -> tuple[int, int]:
    head = g.head_bytes // part.subdivide
    count = g.heads_per_rank - part.first_head if part.num_heads is None else part.num_heads
    return part.first_head * head, count * head
