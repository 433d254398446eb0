"""Checksums of the bytes a transfer moves, computed where the KV lives: numpy on host memory,
torch on a GPU (the same arithmetic, so P and D agree whatever memory each side has).

The checksum covers a transfer's descriptor rows in order, each row's bytes as little-endian
64-bit words (a row is zero-padded to whole words): `s1 = sum(w)` and `s2 = sum(w * (2k + 1))`
over the stream's word positions `k`, both mod 2^64, then both and the word count through
blake2b (8 bytes). Why this hash
and not crc32 or xxhash: it is one multiply and two sums per word, which numpy and torch both
run at memory speed with no extra package, identically on the host and on a GPU (a crc has no
torch kernel); every single flipped bit changes `s2` (an odd weight times a power of two is
never 0 mod 2^64), and a row moved or swapped changes the weights its words meet. It is not a
defence against an adversary (a forger could cancel a change); the shared secret is that.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvfsm.layout import Int64Array
from kvfsm.runtime._kv import KvCache

__all__ = ["Checksum", "corrupt_after_checksum", "corrupt_bytes_after_checksum", "kv_checksum"]

_MASK = (1 << 64) - 1
_CHUNK_WORDS = 1 << 17  # 1 MiB of words per step: bounded temporaries, cached weights
_WEIGHTS = np.arange(_CHUNK_WORDS, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
_torch_weights: dict[Any, Any] = {}  # device -> the same weights as a torch int64 tensor


class Checksum:
    """The running checksum of a stream of words (see the module docstring)."""

    def __init__(self) -> None:
        self.s1 = self.s2 = self.words = 0

    def update(self, data: Any) -> None:
        """Add the bytes of `data`: a 1-D uint8 numpy array or torch tensor whose length is a
        multiple of 8 (rows are padded by the caller)."""
        for start in range(0, len(data), _CHUNK_WORDS * 8):
            self._chunk(data[start : start + _CHUNK_WORDS * 8])

    def _chunk(self, data: Any) -> None:
        n = len(data) // 8
        if isinstance(data, np.ndarray):
            w = data.view(np.uint64)
            s1 = int(w.sum(dtype=np.uint64))
            s2 = int(np.dot(w, _WEIGHTS[:n]))  # uint64 dot: wraps mod 2^64 like the sum
        else:
            w = data.view(_torch().int64)
            s1 = int(w.sum())
            s2 = int((w * _weights_on(w.device)[:n]).sum())
        self.s1 = (self.s1 + s1) & _MASK
        self.s2 = (self.s2 + s2 + 2 * self.words * s1) & _MASK
        self.words += n

    @property
    def value(self) -> int:
        """The checksum so far, in [0, 2^64): the sums and the length through blake2b, so that
        whatever changes either sum changes it (a plain mix of them can cancel)."""
        state = b"".join(x.to_bytes(8, "little") for x in (self.s1, self.s2, self.words & _MASK))
        return int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little")


def kv_checksum(kv: KvCache, rows: Int64Array) -> int:
    """The checksum of the bytes of `rows` ((address, length, device) descriptor rows of `kv`'s
    memory), in order: computed on the GPU for VRAM, on the host otherwise."""
    total = Checksum()
    for segment in _segments(kv, rows):
        total.update(segment)
    return total.value


def corrupt_after_checksum(times: int = 1) -> Callable[[KvCache, Int64Array], int]:
    """A negative control's checksum (never for serving): the true one, after which the first
    byte of the rows is flipped, `times` times: the bytes that then move are not the ones summed,
    as if corrupted between P's memory and D's."""
    left = [times]

    def checksum(kv: KvCache, rows: Int64Array) -> int:
        value = kv_checksum(kv, rows)
        if left[0] > 0 and len(rows):
            left[0] -= 1
            first = _view(kv, int(rows[0, 0]), 1)
            first[0] ^= 0xFF
        return value

    return checksum


def corrupt_bytes_after_checksum(
    targets: set[int],
) -> Callable[[KvCache, Int64Array], int]:
    """A negative control's checksum (never for serving): the true one, after which each byte
    address of `targets` those rows cover is flipped (and forgotten): a chosen request's KV
    goes out wrong after P summed it. Add to `targets` on the engine's thread."""

    def checksum(kv: KvCache, rows: Int64Array) -> int:
        value = kv_checksum(kv, rows)
        for address in [a for a in targets if _covers(rows, a)]:
            targets.discard(address)
            byte = _view(kv, address, 1)
            byte[0] ^= 0xFF
        return value

    return checksum


def _covers(rows: Int64Array, address: int) -> bool:
    return bool(np.any((rows[:, 0] <= address) & (address < rows[:, 0] + rows[:, 1])))


def _segments(kv: KvCache, rows: Int64Array) -> Iterator[Any]:
    """The rows' bytes as few views as possible: adjacent rows of whole words merged."""
    if not len(rows):
        return
    addresses, lengths = rows[:, 0], rows[:, 1]
    if np.any(lengths % 8):  # rows of part words: each padded on its own
        for address, length in zip(addresses.tolist(), lengths.tolist(), strict=True):
            pad = -length % 8
            view = _view(kv, address, length)
            yield view if not pad else _padded(view, pad)
        return
    breaks = np.flatnonzero(addresses[1:] != addresses[:-1] + lengths[:-1]) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(rows)]))
    for first, last in zip(starts.tolist(), ends.tolist(), strict=True):
        size = int(addresses[last - 1] + lengths[last - 1] - addresses[first])
        yield _view(kv, int(addresses[first]), size)


def _view(kv: KvCache, address: int, size: int) -> Any:
    if kv.mem_type == "DRAM":
        return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))
    for buffer in kv.buffers:  # VRAM: the torch tensor holding it
        base = buffer.data_ptr()
        end = base + buffer.numel() * buffer.element_size()
        if base <= address and address + size <= end:
            flat = buffer.view(_torch().uint8).reshape(-1)
            return flat[address - base : address - base + size]
    raise ValueError(f"rows at {address:#x}+{size} lie outside the KV buffers")


def _padded(view: Any, pad: int) -> Any:
    if isinstance(view, np.ndarray):
        return np.concatenate((view, np.zeros(pad, dtype=np.uint8)))
    torch = _torch()
    return torch.cat((view, torch.zeros(pad, dtype=torch.uint8, device=view.device)))


def _weights_on(device: Any) -> Any:
    weights = _torch_weights.get(device)
    if weights is None:
        torch = _torch()
        weights = torch.arange(_CHUNK_WORDS, dtype=torch.int64, device=device) * 2 + 1
        _torch_weights[device] = weights
    return weights


def _torch() -> Any:
    import torch  # only where the KV is torch's: host-only engines need no torch

    return torch
