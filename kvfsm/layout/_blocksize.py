"""Block-size ratio: pairing blocks of two engines whose blocks hold different token counts.

When one side's blocks hold k times the tokens of the other's, the bigger blocks are addressed as
k sub-blocks ("kernel blocks") each the size of a small block, and a request's logical block ids
on that side expand to kernel ids: logical block `b` is kernel blocks `b*k .. b*k + k-1`. After
the expansion both lists count small blocks and pair up one for one. Sub-block `i` of a big block
holds its tokens `[i, i + 1) * small`, where its page keeps them: one run per head where heads
come first (HND, HNC: both sides then cut their rows head by head), one run per K/V segment where
tokens do (`BlockSlice`). So the big block holds exactly what the engine that owns it wrote.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvfsm.layout._ids import Int64Array, as_id_array, as_ids, positive_int

__all__ = ["align_tail", "block_size_factors", "logical_to_kernel", "pair_units"]


def block_size_factors(local_block_size: int, remote_block_size: int) -> tuple[int, int]:
    """(local k, remote k): how many kernel blocks each side's blocks split into to pair up.

    The side with the smaller blocks gets 1; e.g. local 16, remote 4 -> (4, 1). Raises
    ValueError when neither block size is a multiple of the other.
    """
    local = positive_int(local_block_size, "local block size")
    remote = positive_int(remote_block_size, "remote block size")
    big, small = max(local, remote), min(local, remote)
    if big % small:
        raise ValueError(
            f"block sizes {local} (local) and {remote} (remote) do not pair: the larger must be"
            f" an integer multiple of the smaller ({big} / {small} = {big / small:.3g})"
        )
    return (big // small, 1) if local >= remote else (1, big // small)


def logical_to_kernel(block_ids: npt.ArrayLike, k: int) -> Int64Array:
    """Kernel ids of logical blocks `block_ids` split k ways: [2, 5], k=2 -> [4, 5, 10, 11]."""
    factor = positive_int(k, "block size ratio")
    ids = as_ids(block_ids, None, "block ids")
    kernel: Int64Array = (ids[:, None] * factor + np.arange(factor, dtype=np.int64)).ravel()
    return kernel


def pair_units(
    local_ids: npt.ArrayLike, remote_ids: npt.ArrayLike, local_k: int = 1, remote_k: int = 1
) -> tuple[Int64Array, Int64Array]:
    """A request's local and remote block ids as equal-length kernel id lists, pairing by position.

    Each side's ids expand by its factor (see `block_size_factors`). The last big block of a
    request may be only partly filled, so the expanded side may be longer by fewer than k kernel
    blocks; that tail is dropped. Any other length mismatch (a whole block without a partner,
    e.g. a prefix-cache hit not yet trimmed by the caller) raises ValueError.
    """
    local = logical_to_kernel(local_ids, local_k)
    remote = logical_to_kernel(remote_ids, remote_k)
    n = min(local.size, remote.size)
    for name, units, k in (("local", local, local_k), ("remote", remote, remote_k)):
        if units.size - n >= k:
            raise ValueError(
                f"block lists do not pair: {local.size} local and {remote.size} remote kernel"
                f" blocks; the {name} side has {units.size - n} kernel blocks beyond its last"
                f" partial block (k={k})"
            )
    return local[:n], remote[:n]


def align_tail(
    sender_ids: npt.ArrayLike, receiver_ids: npt.ArrayLike, ratio: int = 1
) -> tuple[Int64Array, Int64Array]:
    """Pair one request's blocks on P (`sender_ids`: all of them) with D's (`receiver_ids`: those
    left after a prefix-cache hit of whole D blocks), unit for unit; D's blocks hold `ratio` times
    the tokens of P's. Returns (P block ids, D kernel ids) of equal length, P's block size each.

    D's hit is `ceil(len(P) / ratio) - len(D)` D blocks, i.e. that many times `ratio` P blocks, so
    P's blocks after those pair in order with D's kernel blocks; D's kernel blocks beyond P's last
    (possibly partial) block hold no tokens and are dropped. Example: 20 tokens, P blocks of 4
    tokens [p0..p4], D blocks of 16 with the first cached and [d] left: ratio 4, hit 1, so p4 pairs
    with kernel block 4*d (tokens 16-19) and kernel blocks 4*d+1.. are dropped. With ratio 1 this is
    P's last len(D) blocks. Raises ValueError when D holds more blocks than P's request fills (no
    partial success) or the ratio is not a positive integer.
    """
    k = positive_int(ratio, "block size ratio")
    # Shape and type only: the ids are range-checked where they select rows (`slice_rows`).
    sender = as_id_array(sender_ids, "P block ids")
    receiver = as_id_array(receiver_ids, "D block ids")
    d_total = -(-sender.size // k)  # D blocks the whole request takes: ceil(P blocks / k)
    hit = d_total - receiver.size
    if hit < 0:
        raise ValueError(
            f"D expects {receiver.size} blocks of {k}x P's block size, but P's {sender.size}"
            f" blocks fill only {d_total}"
        )
    units = sender[hit * k :]
    kernel = receiver if k == 1 else (receiver[:, None] * k + np.arange(k, dtype=np.int64)).ravel()
    return units, kernel[: units.size]
