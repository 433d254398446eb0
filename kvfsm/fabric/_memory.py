"""What a registrable buffer is: address, size, device and NIXL memory type of a numpy byte array
or a torch tensor (duck-typed, so kvfsm never imports torch itself)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["BufferSpan", "buffer_span"]


class BufferSpan(NamedTuple):
    """Where a buffer's bytes are: `address`, `nbytes`, `device` id, NIXL `mem_type`."""

    address: int
    nbytes: int
    device: int
    mem_type: str  # "DRAM" or "VRAM"


def buffer_span(buffer: Any) -> BufferSpan:
    """The span of a contiguous 1-D numpy uint8 array (DRAM) or a contiguous torch tensor (a CPU
    tensor as DRAM, a CUDA tensor as VRAM on its device); TypeError for anything else."""
    if isinstance(buffer, np.ndarray):
        if buffer.ndim != 1 or buffer.dtype != np.uint8 or not buffer.flags.c_contiguous:
            raise TypeError("a KV buffer must be a contiguous 1-D numpy uint8 array")
        return BufferSpan(int(buffer.ctypes.data), buffer.nbytes, 0, "DRAM")
    if all(hasattr(buffer, a) for a in ("data_ptr", "element_size", "numel", "is_contiguous")):
        if not buffer.is_contiguous():
            raise TypeError("a KV buffer must be a contiguous tensor")
        nbytes = int(buffer.numel()) * int(buffer.element_size())
        if buffer.is_cuda:
            return BufferSpan(int(buffer.data_ptr()), nbytes, int(buffer.device.index or 0), "VRAM")
        return BufferSpan(int(buffer.data_ptr()), nbytes, 0, "DRAM")
    raise TypeError(
        f"cannot use {type(buffer).__name__} as KV memory: a numpy uint8 array or a tensor"
    )
