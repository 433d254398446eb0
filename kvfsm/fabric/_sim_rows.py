"""How the simulated fabric reads descriptor rows: which registered region and offset each row
lies in, checked index arrays, how many rows NIXL's prepped path would merge, and the records
of agents' metadata, prepared lists and made transfers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

import msgspec
import numpy as np
import numpy.typing as npt

from kvfsm.fabric._protocol import FabricError, XferOp

__all__ = [
    "I64",
    "META_KIND",
    "BytesObserver",
    "Dlist",
    "Meta",
    "Region",
    "Xfer",
    "check_buffer",
    "copy_rows",
    "indices",
    "merged_rows",
    "resolve",
    "written_ranges",
]

I64 = npt.NDArray[np.int64]
BytesObserver: TypeAlias = Callable[[str, list[tuple[int, int]], str, list[tuple[int, int]]], None]
"""Told of every landing: (agent written, ranges written, agent read, ranges read)."""
META_KIND = "kvfsm-sim/1"


class Meta(msgspec.Struct, frozen=True):
    """An agent's metadata, as peers load it: a snapshot of its memory at export time."""

    kind: str
    net: int  # the network's id
    name: str
    gen: int  # incarnation: a revived agent is a new one
    regions: list[tuple[int, int, int]]  # (memory handle, address, length) at export time


@dataclass(slots=True)
class Dlist:
    """A prepared descriptor list: per row, the memory handle, the offset inside it, the length."""

    peer: str | None  # None: local memory
    gen: int  # incarnation owning the memory
    region: I64  # per row: memory handle, offset inside it, length
    offset: I64
    length: I64


@dataclass(slots=True)
class Region:
    """A registered buffer: its bytes, host address and length."""

    buf: npt.NDArray[np.uint8]
    addr: int
    length: int


@dataclass(slots=True)
class Xfer:
    """A made transfer: its paired rows, notification and progress."""

    op: XferOp
    peer: str
    gen: int  # target incarnation
    local_region: I64  # per paired row
    local_offset: I64
    remote_region: I64
    remote_offset: I64
    length: I64
    notif: bytes
    merged: int  # rows once those adjacent on both sides are merged, as NIXL's prepped path does
    state: Literal["NEW", "PROC", "DONE", "ERR"] = "NEW"
    post: int = 0  # bumped by every post so that a stale completion event is ignored
    posted_at: float = 0.0
    done_at: float = 0.0


def resolve(descs: object, regions: dict[int, tuple[int, int]], owner: str) -> tuple[I64, I64]:
    """Map descriptor rows to (memory handle, offset); rows outside every region are an error."""
    if not (isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] == 3):
        raise FabricError("descriptors must be an int64 array of shape (n, 3)")
    if descs.dtype != np.int64:
        raise FabricError(f"descriptors must be int64, got {descs.dtype}")
    addr, length, dev = descs[:, 0], descs[:, 1], descs[:, 2]
    region = np.full(len(descs), -1, dtype=np.int64)
    offset = np.zeros(len(descs), dtype=np.int64)
    for handle, (base, size) in sorted(regions.items()):
        # `length <= base + size - addr` instead of `addr + length <= end`: no int64 overflow.
        inside = (region < 0) & (dev == 0) & (addr >= base) & (addr <= base + size)
        inside &= (length >= 0) & (length <= base + size - addr)
        region[inside] = handle
        offset[inside] = addr[inside] - base
    bad = np.flatnonzero(region < 0)
    if bad.size:
        i = int(bad[0])
        row = tuple(int(v) for v in descs[i])
        raise FabricError(
            f"descriptor row {i} (addr, len, dev)={row} is not inside memory registered by {owner}"
        )
    return region, offset


def merged_rows(lr: I64, lo: I64, rr: I64, ro: I64, length: I64) -> int:
    """Rows left after merging each row into the previous one when it continues it on both sides."""
    if not len(length):
        return 0
    joins = (lr[1:] == lr[:-1]) & (lo[1:] == lo[:-1] + length[:-1])
    joins &= (rr[1:] == rr[:-1]) & (ro[1:] == ro[:-1] + length[:-1])
    return int(len(length) - np.count_nonzero(joins))


def indices(idx: object, n: int, what: str) -> I64:
    if not (isinstance(idx, np.ndarray) and idx.ndim == 1 and idx.dtype.kind in "iu"):
        raise FabricError(f"{what} must be a 1-D integer array")
    out = idx.astype(np.int64)
    bad = np.flatnonzero((out < 0) | (out >= n))
    if bad.size:
        raise FabricError(f"{what}[{int(bad[0])}]={int(out[bad[0]])} is out of range for {n} rows")
    return out


def check_buffer(buffer: object) -> None:
    """Raise unless `buffer` is what `register_memory` takes: a contiguous, writeable,
    non-empty 1-D ``uint8`` numpy array."""
    if not isinstance(buffer, np.ndarray) or buffer.dtype != np.uint8:
        raise TypeError("register_memory needs a numpy uint8 array")
    if buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise ValueError("register_memory needs a contiguous 1-D array")
    if buffer.size == 0 or not buffer.flags.writeable:
        raise ValueError("register_memory needs a non-empty, writeable array")


def written_ranges(
    x: Xfer, regions: dict[int, Region], rows: int | None = None, *, read: bool = False
) -> list[tuple[int, int]]:
    """The host-address ranges [start, end) that the first `rows` pairs of `x` (all by default)
    write, given the written agent's regions by memory handle; with `read`, the ranges they read,
    given the read agent's. Rows in regions gone since are left out."""
    remote = (x.op == "WRITE") != read
    handles, offsets = (
        (x.remote_region, x.remote_offset) if remote else (x.local_region, x.local_offset)
    )
    out = []
    for h, off, n in zip(handles[:rows], offsets[:rows], x.length[:rows], strict=True):
        region = regions.get(int(h))
        if region is not None:
            start = region.addr + int(off)
            out.append((start, start + int(n)))
    return out


def copy_rows(x: Xfer, rows: int, local: dict[int, Region], remote: dict[int, Region]) -> bool:
    """Copy the first `rows` pairs of `x` between the two agents' regions (by memory handle);
    False (nothing copied) if some memory is gone."""
    mine = [local.get(int(h)) for h in x.local_region[:rows]]
    theirs = [remote.get(int(h)) for h in x.remote_region[:rows]]
    if any(r is None for r in mine) or any(r is None for r in theirs):
        return False
    for i, (lr, rr) in enumerate(zip(mine, theirs, strict=True)):
        assert lr is not None and rr is not None  # checked above; narrows for mypy
        n, lo, ro = int(x.length[i]), int(x.local_offset[i]), int(x.remote_offset[i])
        if x.op == "WRITE":
            rr.buf[ro : ro + n] = lr.buf[lo : lo + n]
        else:
            lr.buf[lo : lo + n] = rr.buf[ro : ro + n]
    return True
