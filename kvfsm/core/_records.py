"""What a side keeps: a record per request (with the tally of its transfers) and per peer rank.

They are msgspec structs untracked by the cycle collector (gc=False: they hold no reference
cycles), which keeps collection pauses flat with 10,000 requests in flight.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kvfsm.core._dispatch import FlatHistory, History, unflatten
from kvfsm.core._io import TransferStatus
from kvfsm.layout import id_bounds
from kvfsm.wire import BlockIds

__all__ = ["EngineRecord", "Peer", "Request", "TransferTally", "caller_blocks", "link_status"]


def caller_blocks(request_id: str, blocks: Any) -> BlockIds:
    """The caller's block ids as a 1-D int32 array, checked once here (messages then carry them
    without further checks)."""
    ids = np.asarray(blocks)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise TypeError(f"{request_id!r}: block ids must be a 1-D integer array, got {ids!r:.80}")
    if ids.size:
        lo, hi = id_bounds(ids)
        if lo < 0 or hi >= 2**31:
            raise ValueError(f"{request_id!r}: block ids must lie in [0, 2**31)")
    return ids.astype(np.int32, copy=False)


class TransferTally(msgspec.Struct, gc=False):
    """The results of one request's transfers, counted by the `transfer` lifecycle."""

    id: str
    expected: int
    state: str = "open"
    history: FlatHistory | None = None  # kept for requests only (`Side._new_request`)
    ok: int = 0
    failed: int = 0
    reported: tuple[str, ...] = ()  # whose result came (few peers: smaller than a dict)


class Request(msgspec.Struct, gc=False):
    """One request on one side: its lifecycle state, blocks, peers and transfer tally."""

    id: str
    state: str
    blocks: BlockIds
    tally: TransferTally
    history: FlatHistory | None = None  # when tracing is on (see `Instance`)
    abort_requested: bool = False
    peers: tuple[str, ...] = ()
    peer_request_id: str = ""
    base_id: str = ""  # P: the id without its random suffix (matching and tombstones use it)
    links: dict[str, Any] = msgspec.field(default_factory=dict)  # per peer agent: its part
    acks: frozenset[str] = frozenset()
    lost: frozenset[str] = frozenset()  # peers lost while the request used them
    consumer_released: bool = False
    released: bool = False  # its blocks were handed back or are held to be (exactly once)
    reported: bool = False  # D: its outcome was reported to the caller

    def transitions(self) -> History:
        """Its history so far, (event, state entered, time) per transition (empty untraced)."""
        return () if self.history is None else unflatten(self.history)


class Peer(msgspec.Struct, gc=False):
    """One remote engine rank, the requests waiting for a connection to it, and the replies that
    wait for it (to a peer P never connected to, e.g. a failure before the match)."""

    id: str
    state: str = "unknown"
    history: FlatHistory | None = None  # kept for requests only (`Side._new_request`)
    waiters: dict[str, None] = msgspec.field(default_factory=dict)
    outbox: list[bytes] = msgspec.field(default_factory=list)
    contact: str = ""  # where its side channel listens, once learned
    clock_offset: float = 0.0  # its clock minus ours, from the handshakes
    clock_error: float = 0.0  # how far off that offset may be (half the handshake's transit)
    clock_measured: bool = False  # whether a handshake measured them yet
    idle_since: float = 0.0  # when a sweep last saw a live request use it
    incarnation: int = 0  # the process the last handshake reached (0: unknown)

    def measured(self, offset: float, error: float) -> None:
        """Take one handshake's estimate of the peer's clock. Consistent with what earlier ones
        said (the intervals meet), it narrows the estimate to what both allow, so one slow
        handshake (answered after an outage) cannot widen it; inconsistent (the peer's clock is
        another one now: a host restarted), it replaces it."""
        lo = max(self.clock_offset - self.clock_error, offset - error)
        hi = min(self.clock_offset + self.clock_error, offset + error)
        if self.clock_measured and lo <= hi:
            self.clock_offset, self.clock_error = (lo + hi) / 2, (hi - lo) / 2
        else:
            self.clock_offset, self.clock_error, self.clock_measured = offset, error, True


def link_status(ok: bool | None, under_way: bool) -> TransferStatus:
    """What a side says of one peer's transfer: its counted result, else whether it is under
    way (posted or granted) or not yet."""
    if ok is not None:
        return "done" if ok else "failed"
    return "transferring" if under_way else "waiting"


class EngineRecord(msgspec.Struct, gc=False):
    """The local engine, as the `engine` lifecycle runs it (serving, draining, drained, closed)."""

    id: str
    state: str = "serving"
    history: FlatHistory | None = None  # kept for requests only (`Side._new_request`)
