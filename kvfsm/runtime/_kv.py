"""One engine rank's KV memory: its geometry and the buffers that hold its regions."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfsm.fabric import buffer_span
from kvfsm.layout import KvGeometry, RegionLayout

__all__ = ["KvCache"]


class KvCache:
    """The registered KV cache of one engine rank.

    `buffers` is either one buffer holding every region back to back (in `RegionLayout`'s
    order: layer-major, K before V when split) or one buffer per region (e.g. a serving
    engine's per-layer tensors). Buffers are numpy uint8 arrays or torch tensors (CPU: DRAM,
    CUDA: VRAM); the cache keeps them alive while it exists.
    """

    def __init__(self, geometry: KvGeometry, buffers: Sequence[Any]) -> None:
        g = geometry
        spans = [buffer_span(b) for b in buffers]
        if len(spans) not in (1, g.num_regions):
            raise ValueError(
                f"{len(spans)} KV buffers: give one holding all {g.num_regions} regions, or one"
                f" per region"
            )
        if len({(s.device, s.mem_type) for s in spans}) != 1:
            raise ValueError("every KV buffer of one rank must be on the same device")
        if g.interleaved and len(spans) != 1:
            raise ValueError("interleaved regions share one buffer: give the whole cache")
        if len(spans) == 1:
            step = g.block_len if g.interleaved else g.region_bytes
            need, bases = g.kv_bytes, [spans[0].address + i * step for i in range(g.num_regions)]
        else:
            need, bases = g.region_bytes, [s.address for s in spans]
        wrong = [i for i, s in enumerate(spans) if s.nbytes != need]
        if wrong:
            raise ValueError(
                f"KV buffer {wrong[0]} has {spans[wrong[0]].nbytes} bytes; the geometry needs"
                f" {need} ({g.num_blocks} blocks of {g.block_len} bytes per region)"
            )
        self.geometry = g
        self.buffers = tuple(buffers)
        self.mem_type = spans[0].mem_type
        self.layout = RegionLayout(g, tuple(bases), device=spans[0].device)

    @classmethod
    def allocate(cls, geometry: KvGeometry) -> KvCache:
        """A zeroed, resident host buffer for every region of `geometry`.

        Every page is written now (np.zeros would map them lazily): a serving engine's KV cache
        is resident, and first-touch page faults would otherwise land inside the first
        transfers into it (docs/performance.md)."""
        buffer = np.empty(geometry.kv_bytes, dtype=np.uint8)
        buffer.fill(0)
        return cls(geometry, [buffer])

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies over all regions."""
        return self.geometry.block_len * self.geometry.num_regions

    def regions(self) -> list[npt.NDArray[np.uint8]]:
        """A byte view of each region (host memory only): flat, or (blocks, block bytes) when
        the regions are interleaved."""
        if self.mem_type != "DRAM":
            raise TypeError(f"the regions of {self.mem_type} memory are not visible from the host")
        g = self.geometry
        size = g.region_bytes
        if g.interleaved:
            whole = _host_bytes(self.layout.base_addresses[0], g.kv_bytes)
            pages = whole.reshape(g.num_blocks, g.num_regions, g.block_len)
            return [pages[:, i, :] for i in range(g.num_regions)]
        if len(self.buffers) == 1 and isinstance(self.buffers[0], np.ndarray):
            whole = self.buffers[0]
            return [whole[i * size : (i + 1) * size] for i in range(self.geometry.num_regions)]
        return [_host_bytes(base, size) for base in self.layout.base_addresses]

    def fill_blocks(self, blocks: npt.ArrayLike, value: int) -> None:
        """Set every byte of `blocks` in every region to `value` (e.g. to poison freed blocks)."""
        ids = np.asarray(blocks, dtype=np.int64)
        for region in self.regions():
            region.reshape(self.geometry.num_blocks, self.geometry.block_len)[ids] = value

    def __repr__(self) -> str:
        g = self.geometry
        pages = f"{g.kv_layout} pages" + (", blocks outermost" if g.interleaved else "")
        return (
            f"KvCache({g.num_regions} regions x {g.num_blocks} blocks x {g.block_len} bytes,"
            f" {pages}, {self.mem_type}, TP rank {g.tp_rank}/{g.tp_size})"
        )


def _host_bytes(address: int, size: int) -> npt.NDArray[np.uint8]:
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))
