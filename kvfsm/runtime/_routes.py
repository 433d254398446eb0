"""How one engine rank moves a request's KV with one peer rank: the TP pairing planned from both
geometries, the descriptor lists prepared for it, and the rows a request's blocks select."""

from __future__ import annotations

import functools
from typing import NamedTuple

from kvfsm.fabric import DlistHandle, Fabric
from kvfsm.layout import (
    Int64Array,
    KvGeometry,
    RankPairing,
    RegionLayout,
    SliceRows,
    align_tail,
    logical_to_kernel,
    plan_pairings,
)
from kvfsm.runtime._kv import KvCache
from kvfsm.wire import BlockIds

__all__ = ["Route", "plan_route", "prepare_route"]


class Route(NamedTuple):
    """This rank's way of moving KV with one peer rank.

    `pairing` is None when another rank of this side moves the bytes (replicated MLA KV) and this
    one only sends its completion notification. `local`/`remote` are prepared descriptor lists
    (None on the side that never posts in its mode).
    """

    pairing: RankPairing | None
    ratio: int  # D's block size / P's block size
    local_is_p: bool
    maps: tuple[SliceRows, SliceRows] | None = None  # the pairing's unit -> row mappings
    local: DlistHandle | None = None
    remote: DlistHandle | None = None
    row_bytes: int = 0
    descriptors: tuple[Int64Array, Int64Array] | None = None  # the prepared lists' rows

    def rows(
        self, local_blocks: BlockIds, remote_blocks: BlockIds
    ) -> tuple[Int64Array, Int64Array]:
        """Local and remote row ids for one request's blocks, aligned at D's prefix-cache hit.
        ValueError when the blocks cannot pair (D holds more than P's request fills) or lie
        outside either side's cache."""
        assert self.maps is not None and self.pairing is not None, "a notify-only route"
        local_map, remote_map = self.maps
        p_blocks, d_blocks = (
            (local_blocks, remote_blocks) if self.local_is_p else (remote_blocks, local_blocks)
        )
        p_units, d_units = align_tail(p_blocks, d_blocks, self.ratio)
        split = self.pairing.unit_split
        if split > 1:  # head slices of tokens-first pages: a row per token
            p_units, d_units = logical_to_kernel(p_units, split), logical_to_kernel(d_units, split)
        if self.local_is_p:
            return local_map(p_units), remote_map(d_units)
        return local_map(d_units), remote_map(p_units)


@functools.lru_cache(maxsize=256)
def plan_route(local: KvGeometry, peer: KvGeometry, *, local_is_p: bool) -> Route:
    """The pairing of this rank with the peer rank `peer` (from its handshake); ValueError saying
    why when their KV caches cannot exchange blocks.

    Planned once per pair of geometries: the handshake plans it to validate the peer's answer,
    and the engine that then connects gets the same route, unprepared, from the cache."""
    plan = plan_pairings(local, peer, local_receives=not local_is_p)
    if peer.tp_rank not in plan.partners:
        raise ValueError(
            f"rank {local.tp_rank}/{local.tp_size} exchanges KV with peer ranks"
            f" {list(plan.partners)} of {peer.tp_size}, not with rank {peer.tp_rank}"
        )
    p_bs, d_bs = (
        (local.block_size, peer.block_size) if local_is_p else (peer.block_size, local.block_size)
    )
    if d_bs % p_bs:
        raise ValueError(
            f"P's blocks of {p_bs} tokens must divide D's blocks of {d_bs} tokens (D's prefix-cache"
            f" hits are whole D blocks, which must be whole P blocks too)"
        )
    pairing = next((p for p in plan.pairings if p.remote_rank == peer.tp_rank), None)
    maps = pairing.row_maps() if pairing is not None else None
    return Route(pairing, d_bs // p_bs, local_is_p, maps)


def prepare_route(
    route: Route, fabric: Fabric, kv: KvCache, peer: str, layout: RegionLayout
) -> Route:
    """`route` with its local and remote descriptor lists prepared on `fabric` (the peer's agent
    must be loaded); nothing to prepare for a notify-only route."""
    if route.pairing is None:
        return route
    rows = route.pairing.local_descriptors(kv.layout)
    far = route.pairing.remote_descriptors(layout)
    local = fabric.prep_xfer_dlist(None, rows)
    try:
        remote = fabric.prep_xfer_dlist(peer, far)
    except BaseException:
        fabric.release_dlist_handle(local)
        raise
    return route._replace(
        local=local,
        remote=remote,
        row_bytes=int(rows[0, 1]) if len(rows) else 0,
        descriptors=(rows, far),
    )
