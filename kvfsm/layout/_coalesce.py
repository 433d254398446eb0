"""Merge paired descriptor rows that are contiguous on both sides into fewer, larger rows.

Posting cost grows with the descriptor count (a fragmented request can need thousands), and
`initialize_xfer` does not merge adjacent descriptors itself. Row i joins row i-1 when, on the
local side and on the remote side alike, it starts where row i-1 ends (and stays on the same
device); a merged row spans the whole run. The byte mapping (local byte -> remote byte) is
unchanged, only cut into fewer pieces.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvfsm.layout._ids import Int64Array

__all__ = ["Coalesced", "coalesce"]


class Coalesced(NamedTuple):
    """Merged local and remote rows (same columns as given) and the row counts around the merge."""

    local: Int64Array
    remote: Int64Array
    before: int
    after: int


def coalesce(local: npt.ArrayLike, remote: npt.ArrayLike) -> Coalesced:
    """Merge runs of rows contiguous on both sides; rows are (addr, len) or (addr, len, dev).

    Row i of `local` pairs with row i of `remote`, and paired rows must have equal positive
    lengths; ValueError otherwise.
    """
    loc, rem = _rows(local, "local"), _rows(remote, "remote")
    if loc.shape[0] != rem.shape[0]:
        raise ValueError(f"{loc.shape[0]} local rows cannot pair with {rem.shape[0]} remote rows")
    n = loc.shape[0]
    if n == 0:
        return Coalesced(loc.copy(), rem.copy(), 0, 0)
    if np.any(loc[:, 1] <= 0):
        raise ValueError("descriptor lengths must be positive")
    unequal = np.flatnonzero(loc[:, 1] != rem[:, 1])
    if unequal.size:
        i = int(unequal[0])
        raise ValueError(
            f"paired rows must have equal lengths: row {i} is {loc[i, 1]} bytes locally and"
            f" {rem[i, 1]} bytes remotely ({unequal.size} such rows)"
        )
    joins = _continues(loc) & _continues(rem)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(loc[:, 1], starts)
    merged_local, merged_remote = loc[starts], rem[starts]
    merged_local[:, 1] = lengths
    merged_remote[:, 1] = lengths
    return Coalesced(merged_local, merged_remote, n, int(starts.size))


def _continues(rows: Int64Array) -> npt.NDArray[np.bool_]:
    """For rows 1..n-1: does the row start where the previous one ends (same device)?"""
    adjacent: npt.NDArray[np.bool_] = np.diff(rows[:, 0]) == rows[:-1, 1]
    if rows.shape[1] == 3:
        adjacent &= np.diff(rows[:, 2]) == 0
    return adjacent


def _rows(values: npt.ArrayLike, what: str) -> Int64Array:
    arr = np.asarray(values)
    if arr.ndim == 1 and arr.size == 0:
        # An empty Python list: no rows, and no column count to check.
        return np.zeros((0, 3), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3):
        raise ValueError(f"{what} rows must have shape (n, 2) or (n, 3), got {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{what} rows must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)
