"""Checked conversion of caller-supplied id lists (block ids, region ids, layer ids) to int64.

Every public function of the layout package takes ids from outside (a scheduler, a peer's
registration), so they are checked once here, with vectorised min/max instead of a loop.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["Int64Array", "as_id_array", "as_ids", "id_bounds", "positive_int"]

Int64Array = npt.NDArray[np.int64]
"""A numpy array of int64: descriptor rows, descriptor ids, block ids."""

_FEW_IDS = 64
"""Up to this many ids, Python's min/max over a list beat numpy's reductions, which cost the
same whatever the size (docs/performance.md)."""


def id_bounds(ids: npt.NDArray[np.integer]) -> tuple[int, int]:
    """The smallest and largest id of a non-empty 1-D integer array."""
    if ids.size <= _FEW_IDS:
        values = ids.tolist()
        return min(values), max(values)
    return int(ids.min()), int(ids.max())


def as_ids(values: npt.ArrayLike, upper: int | None, what: str) -> Int64Array:
    """`values` as a 1-D int64 array, each in [0, upper) (or >= 0 when `upper` is None).

    Raises ValueError naming `what` for non-integer dtypes (a float id would be truncated
    silently by a cast), other shapes, or values out of range.
    """
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array, got shape {arr.shape}")
    # An empty Python list arrives as float64; it has no value to truncate, so accept it.
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what} exceed the int64 range (largest {int(arr.max())})")
    ids = arr.astype(np.int64, copy=False)
    lo, hi = id_bounds(ids)
    if lo < 0 or (upper is not None and hi >= upper):
        bound = f"[0, {upper})" if upper is not None else "[0, inf)"
        raise ValueError(f"{what} must lie in {bound}, got values from {lo} to {hi}")
    return ids


def as_id_array(values: npt.ArrayLike, what: str) -> Int64Array:
    """`values` as a 1-D int64 array, checking shape and integer type but not the range (for hot
    paths whose ids are range-checked where they are used)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def positive_int(value: object, what: str) -> int:
    """`value` if it is an int >= 1 (bool excluded), else ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)
