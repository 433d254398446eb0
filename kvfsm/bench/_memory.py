"""Where `kvfsm bench` keeps the KV caches: host memory (DRAM, numpy) or one CUDA device's
memory (VRAM, torch tensors registered as VRAM), and the copy that bounds each from above."""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = ["MEMORIES", "Memory", "allocate", "copy_gbps", "on_host", "unavailable"]

Memory = Literal["dram", "vram"]
MEMORIES: tuple[Memory, ...] = ("dram", "vram")


def unavailable(memory: Memory) -> str | None:
    """Why `memory` cannot be benchmarked here (None: it can)."""
    if memory == "dram":
        return None
    import torch

    if not torch.cuda.is_available():
        return "--memory vram needs a CUDA device, and torch sees none here"
    return None


def allocate(host: npt.NDArray[np.uint8], memory: Memory) -> Any:
    """`host`'s bytes where `memory` says: the array itself, or a copy on the current CUDA
    device (a contiguous uint8 tensor, which NIXL registers as VRAM)."""
    if memory == "dram":
        return host
    import torch

    tensor = torch.from_numpy(host).to("cuda")
    torch.cuda.synchronize()
    return tensor


def on_host(buffer: Any) -> npt.NDArray[np.uint8]:
    """A buffer's bytes as a host array (copied back from a CUDA device)."""
    if isinstance(buffer, np.ndarray):
        return buffer
    import torch

    torch.cuda.synchronize()
    host: npt.NDArray[np.uint8] = buffer.cpu().numpy()
    return host


def copy_gbps(
    src: Any,
    dst: Any,
    shape: tuple[int, int, int],
    moves: list[tuple[list[int], list[int]]],
    repeat: int = 3,
) -> float:
    """GB/s of copying every move's source blocks onto its destination blocks, `src` and `dst`
    seen as (regions, blocks, block bytes): numpy's gather/scatter on the host, torch's on a
    CUDA device (synchronised): the limit a transfer of the same blocks could reach."""
    cuda = not isinstance(src, np.ndarray)
    s, d = src.reshape(shape), dst.reshape(shape)
    index = [_index(a, b, cuda) for a, b in moves]
    best = float("inf")
    for _ in range(repeat):
        _sync(cuda)
        t0 = time.perf_counter()
        for a, b in index:
            d[:, b] = s[:, a]
        _sync(cuda)
        best = min(best, time.perf_counter() - t0)
    moved = sum(len(a) for a, _ in moves) * shape[0] * shape[2]
    return moved / best / 1e9


def _index(a: list[int], b: list[int], cuda: bool) -> tuple[Any, Any]:
    if not cuda:
        return a, b
    import torch

    return (torch.tensor(a, device="cuda"), torch.tensor(b, device="cuda"))


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()
