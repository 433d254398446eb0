"""Block-size ratio: logical -> kernel ids, the factors, and pairing request block lists."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvfsm.layout import (
    KvGeometry,
    align_tail,
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


# --- align_tail: a D prefix-cache hit with different block sizes --------------------------------


def test_align_tail_equal_blocks_takes_p_s_last_blocks() -> None:
    # Same block size: D cached the first 2 of 5 blocks and fills 3; they pair with P's last 3.
    p_units, d_units = align_tail([10, 11, 12, 13, 14], [7, 8, 9])
    np.testing.assert_array_equal(p_units, [12, 13, 14])
    np.testing.assert_array_equal(d_units, [7, 8, 9])


def test_align_tail_worked_example_from_the_docstring() -> None:
    # 20 tokens; P blocks of 4 tokens [p0..p4] = ids 10..14; D blocks of 16 tokens, the first
    # cached, [d] = 7 left. D's block holds tokens 16-31: only tokens 16-19 exist, in p4 (id 14).
    p_units, d_units = align_tail([10, 11, 12, 13, 14], [7], ratio=4)
    np.testing.assert_array_equal(p_units, [14])
    np.testing.assert_array_equal(d_units, [28])  # kernel block 4*7: D block 7's first quarter
    # Pairing from the end instead (P's last 4 blocks, p1..p4 = tokens 4-19) would put tokens 4-7
    # where 16-19 belong.


@pytest.mark.parametrize(
    ("p", "d", "ratio", "want_p", "want_d"),
    [
        ([1, 2, 3, 4], [8, 9], 2, [1, 2, 3, 4], [16, 17, 18, 19]),  # no hit, whole blocks
        ([1, 2, 3], [8, 9], 2, [1, 2, 3], [16, 17, 18]),  # no hit, D's last block half full
        ([1, 2, 3], [9], 2, [3], [18]),  # D cached its first block (= P's 1 and 2)
        ([1, 2, 3, 4, 5, 6], [9], 4, [5, 6], [36, 37]),  # D cached 1 block of 4 P blocks
        ([1, 2, 3], [], 2, [], []),  # a full hit: nothing to move
        ([], [], 3, [], []),
    ],
)
def test_align_tail_hand_computed(
    p: list[int], d: list[int], ratio: int, want_p: list[int], want_d: list[int]
) -> None:
    p_units, d_units = align_tail(p, d, ratio)
    np.testing.assert_array_equal(p_units, want_p)
    np.testing.assert_array_equal(d_units, want_d)
    assert p_units.dtype == d_units.dtype == np.int64


@pytest.mark.parametrize(
    ("p", "d", "ratio", "message"),
    [
        ([1], [8, 9], 1, "D expects 2 blocks of 1x P's block size, but P's 1 blocks fill only 1"),
        ([1, 2, 3], [7, 8, 9], 2, "P's 3 blocks fill only 2"),
        ([], [4], 2, "P's 0 blocks fill only 0"),  # P has no KV for a request D wants
        ([1], [1], 0, "block size ratio must be a positive integer"),
        ([1.5], [1], 1, "P block ids must be integers"),
    ],
)
def test_align_tail_refuses_what_cannot_pair(
    p: list[object], d: list[int], ratio: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        align_tail(p, d, ratio)  # type: ignore[arg-type]


def test_unit_ids_equal_transfer_ids_without_a_hit() -> None:
    d = KvGeometry(
        num_layers=2, num_kv_heads=2, head_dim=2, dtype_bytes=2, block_size=8, num_blocks=4
    )
    p = msgspec.structs.replace(d, block_size=4, num_blocks=8)
    (pairing,) = plan_pairings(d, p).pairings
    d_blocks, p_blocks = [3, 1], [5, 0, 7, 2]
    p_units, d_units = align_tail(p_blocks, d_blocks, ratio=2)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            pairing.unit_ids(d_units, p_units),
            pairing.transfer_ids(d_blocks, p_blocks),
            strict=True,
        )
    )


def test_the_seed_s_worked_examples_of_mapped_blocks() -> None:
    # vLLM's get_mapped_blocks docstring: block_ids=[0, 2], ratio 2 -> 0 1 [2 3] 4 5 -> [0,1,4,5].
    np.testing.assert_array_equal(logical_to_kernel([0, 2], 2), [0, 1, 4, 5])
    # Its _read_blocks note: P blocks of 4 tokens [1..10], D blocks of 16 tokens [1, 2, 3]; D's
    # 12 kernel blocks are clipped to P's 10.
    p_units, d_units = align_tail(list(range(1, 11)), [1, 2, 3], ratio=4)
    np.testing.assert_array_equal(p_units, range(1, 11))
    np.testing.assert_array_equal(d_units, range(4, 14))  # D block 1 = kernel 4..7, ...
