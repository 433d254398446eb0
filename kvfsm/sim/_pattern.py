"""Recognisable KV contents, checkable on any rank of any geometry.

Every byte P's "prefill" writes is a function of where it belongs in the model: the request, the
layer, K or V, the model-wide head, the token's position in the request and the byte within that
head's token. A D rank computes what its own blocks must hold from its own geometry alone, so one
check covers every TP pair (head slices), block-size ratio (kernel blocks), K/V split and
replicated (MLA) KV, with no knowledge of how the bytes travelled.

Blocks are read as their pages lie in memory: a block of `k` pairing units (`unit_tokens`
tokens each, the smaller of the two sides' block sizes) holds the units' tokens one after the
other along its tokens axis, wherever the page layout puts that axis (as vLLM's blocks do).
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvfsm.layout import logical_to_kernel
from kvfsm.runtime import KvCache

__all__ = ["PatternCheck", "check_request", "request_seed", "write_request"]

_U8 = npt.NDArray[np.uint8]


class PatternCheck(NamedTuple):
    """The outcome of comparing a request's blocks with its pattern."""

    compared: int
    """Bytes compared."""
    wrong: int
    """Bytes that differ."""


def request_seed(key: str) -> int:
    """A request's pattern seed, from a key both sides know (e.g. P's request id)."""
    return zlib.crc32(key.encode())


def write_request(kv: KvCache, seed: int, blocks: npt.ArrayLike, *, unit_tokens: int) -> None:
    """Fill `blocks` (holding a request from its first token) with the request's pattern."""
    ids = np.asarray(blocks, dtype=np.int64)
    tokens = ids.size * kv.geometry.block_size
    for view, units, expected in _planes(kv, seed, ids, unit_tokens, 0, tokens):
        view[units] = expected  # (block, sub-block) index pairs: writes through to memory


def check_request(
    kv: KvCache,
    seed: int,
    blocks: npt.ArrayLike,
    *,
    unit_tokens: int,
    first_token: int,
    tokens: int,
) -> PatternCheck:
    """Compare tokens [first_token, first_token + tokens) of a request, held in `blocks` from
    `first_token` on (D's blocks after a prefix-cache hit of `first_token` tokens), with its
    pattern; bytes of tokens past the request's end are not compared."""
    ids = np.asarray(blocks, dtype=np.int64)
    if tokens <= 0 or not ids.size:
        return PatternCheck(0, 0)
    compared = wrong = 0
    order = _ORDER[kv.geometry.kv_layout]
    back = np.argsort(order)
    for view, units, expected in _planes(kv, seed, ids, unit_tokens, first_token, tokens):
        got = _token_major(view[units].transpose(back))[:, :, :tokens]
        want = _token_major(expected.transpose(back))[:, :, :tokens]
        compared += got.size
        wrong += int(np.count_nonzero(got != want))
    return PatternCheck(compared, wrong)


# Axis order in memory of (units, K/V, heads, unit tokens, row bytes), per page layout.
_ORDER = {
    "HND": (0, 1, 2, 3, 4),
    "NHD": (0, 1, 3, 2, 4),
    "HNC": (0, 2, 3, 1, 4),
    "NHC": (0, 3, 2, 1, 4),
}


def _planes(
    kv: KvCache, seed: int, ids: npt.NDArray[np.int64], unit_tokens: int, first: int, tokens: int
) -> list[tuple[_U8, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]], _U8]]:
    """Per region: a view of its memory in the page layout's axis order, the units holding the
    request's tokens, and the bytes they must hold (in the same order)."""
    g = kv.geometry
    if g.block_size % unit_tokens:
        raise ValueError(
            f"blocks of {g.block_size} tokens do not split into {unit_tokens}-token units"
        )
    k = g.block_size // unit_tokens
    n_units = min(-(-tokens // unit_tokens), ids.size * k)
    units = logical_to_kernel(ids, k)[:n_units]
    row = g.head_dim * g.dtype_bytes
    positions = first + np.arange(n_units * unit_tokens, dtype=np.int64)
    token_rows = _mix(positions * 1_000_003 + seed, 1)[:, None] + _mix(np.arange(row), 2)[None, :]
    token_rows = token_rows.reshape(n_units, unit_tokens, row)
    heads = g.first_head + np.arange(g.heads_per_rank, dtype=np.int64)
    order = _ORDER[g.kv_layout]
    out = []
    for region, memory in enumerate(kv.regions()):
        layer = region // g.regions_per_layer
        kvs = [region % 2] if g.split_kv else [0] if g.mla else [0, 1]
        kv_heads = _mix(np.array([layer * 2 + s for s in kvs]), 3)[:, None] + _mix(heads, 4)
        # Canonical (units, K/V, heads, unit tokens, row bytes), then memory order.
        expected = token_rows[:, None, None, :, :] + kv_heads[None, :, :, None, None]
        view = _unit_view(
            memory, g.num_blocks, (len(kvs), g.heads_per_rank), k, unit_tokens, row, order
        )
        out.append(
            (view, (units // k, units % k), expected.astype(np.uint8, copy=False).transpose(order))
        )
    return out


def _unit_view(
    memory: _U8,
    blocks: int,
    kv_heads: tuple[int, int],
    k: int,
    unit_tokens: int,
    row: int,
    order: tuple[int, ...],
) -> _U8:
    """A region's memory as (blocks, k sub-blocks, then the page's axes in memory order with
    `unit_tokens` tokens): a view, so that writing through it writes the cache."""
    page = (0, *kv_heads, k * unit_tokens, row)  # canonical axes 1..4 of one block
    shape = (blocks, *(page[i] for i in order[1:]))
    tokens_axis = order.index(3)
    split = (*shape[:tokens_axis], k, unit_tokens, *shape[tokens_axis + 1 :])
    view: _U8 = np.moveaxis(memory.reshape(split), tokens_axis, 1)
    return view


def _token_major(units: _U8) -> _U8:
    """(units, K/V, heads, unit tokens, row) -> (K/V, heads, tokens, row)."""
    n, kvs, heads, ut, row = units.shape
    return units.transpose(1, 2, 0, 3, 4).reshape(kvs, heads, n * ut, row)


def _mix(values: npt.NDArray[np.int64], salt: int) -> _U8:
    """A byte that looks random per value (multiplicative hashing), different per salt."""
    mixed = ((values * 4 + salt) * 2654435761) % (1 << 32)
    return (mixed >> 24).astype(np.uint8)
