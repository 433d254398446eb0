"""The simplest KV layout: one registered region of equal-sized blocks, one descriptor per block.

The real geometries (per-layer regions, K/V split, TP head slices, block-size ratios, coalescing)
build on this in later work; the engine only needs block ids -> descriptor rows.
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = ["BlockLayout"]


class BlockLayout(msgspec.Struct, frozen=True):
    """`num_blocks` blocks of `block_bytes` bytes each, contiguous in one region."""

    num_blocks: int
    block_bytes: int

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_bytes < 1:
            raise ValueError(f"a layout needs blocks and bytes: {self!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of the whole region."""
        return self.num_blocks * self.block_bytes

    def descriptors(self, base_address: int) -> npt.NDArray[np.int64]:
        """One row (address, length, device 0) per block, block id = row index."""
        rows = np.zeros((self.num_blocks, 3), dtype=np.int64)
        rows[:, 0] = base_address + np.arange(self.num_blocks, dtype=np.int64) * self.block_bytes
        rows[:, 1] = self.block_bytes
        return rows
