"""Block-size ratio: logical -> kernel ids, the factors, and pairing request block lists."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.layout import (
    KvGeometry,
    block_size_factors,
    logical_to_kernel,
    pair_units,
    plan_pairings,
)


def test_logical_to_kernel_examples() -> None:
    np.testing.assert_array_equal(logical_to_kernel(np.array([2, 5]), 2), [4, 5, 10, 11])
    np.testing.assert_array_equal(
        logical_to_kernel([0, 1, 3], 4), [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    )
    np.testing.assert_array_equal(logical_to_kernel([7, 3], 1), [7, 3])
    assert logical_to_kernel([], 3).shape == (0,)
    assert logical_to_kernel([1], 2).dtype == np.int64


@pytest.mark.parametrize(("k", "message"), [(0, "got 0"), (1.5, "got 1.5"), (True, "got True")])
def test_logical_to_kernel_rejects_bad_factor(k: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"block size ratio must be a positive integer, {message}"):
        logical_to_kernel([1], k)  # type: ignore[arg-type]


def test_factors() -> None:
    assert block_size_factors(16, 4) == (4, 1)  # local (D) blocks 4x bigger: D splits its blocks
    assert block_size_factors(4, 16) == (1, 4)
    assert block_size_factors(8, 8) == (1, 1)


@pytest.mark.parametrize(("local", "remote"), [(16, 6), (6, 16), (12, 8)])
def test_non_integer_ratio_raises(local: int, remote: int) -> None:
    with pytest.raises(
        ValueError, match=f"block sizes {local} .local. and {remote} .remote. do not pair"
    ):
        block_size_factors(local, remote)


def test_non_integer_ratio_rejected_by_the_plan() -> None:
    d = KvGeometry(
        num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=1, block_size=16, num_blocks=1
    )
    p = KvGeometry(
        num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=1, block_size=6, num_blocks=1
    )
    with pytest.raises(ValueError, match="incompatible KV geometries: block sizes 16"):
        plan_pairings(d, p)


def test_pair_units_trims_a_partly_filled_last_block() -> None:
    # D block 16 tokens, P block 4: D's [1, 2] cover 32 tokens, P sent 7 blocks (28 tokens).
    local, remote = pair_units([1, 2], [10, 11, 12, 13, 14, 15, 16], local_k=4)
    np.testing.assert_array_equal(local, [4, 5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(remote, [10, 11, 12, 13, 14, 15, 16])
    # Push direction: P (local, small blocks) writes into D (remote, big blocks).
    local, remote = pair_units([3], [5], remote_k=2)
    np.testing.assert_array_equal(local, [3])
    np.testing.assert_array_equal(remote, [10])


@pytest.mark.parametrize(
    ("local", "remote", "local_k", "message"),
    [
        ([1, 2], [10, 11, 12], 4, "the local side has 5 kernel blocks"),
        ([1], [10, 11, 12, 13, 14], 4, "the remote side has 1 kernel blocks"),
        ([1, 2], [5], 1, "the local side has 1 kernel blocks"),
    ],
)
def test_pair_units_rejects_blocks_without_partner(
    local: list[int], remote: list[int], local_k: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        pair_units(local, remote, local_k=local_k)
