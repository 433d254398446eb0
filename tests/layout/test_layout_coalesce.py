"""Coalescing paired descriptor rows: hand cases and a byte-mapping property."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.layout import coalesce


def _rows(*pairs: tuple[int, int]) -> npt.NDArray[np.int64]:
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def test_contiguous_run_becomes_one() -> None:
    out = coalesce(_rows((0, 10), (10, 10), (20, 10)), _rows((100, 10), (110, 10), (120, 10)))
    np.testing.assert_array_equal(out.local, [[0, 30]])
    np.testing.assert_array_equal(out.remote, [[100, 30]])
    assert (out.before, out.after) == (3, 1)


def test_fragmented_rows_stay() -> None:
    local, remote = _rows((0, 8), (16, 8), (40, 8)), _rows((0, 8), (8, 8), (16, 8))
    out = coalesce(local, remote)  # remote contiguous, local not: nothing merges
    np.testing.assert_array_equal(out.local, local)
    np.testing.assert_array_equal(out.remote, remote)
    assert (out.before, out.after) == (3, 3)


def test_mixed_runs() -> None:
    local = _rows((0, 4), (4, 4), (8, 4), (12, 4), (100, 2), (102, 6), (200, 4))
    remote = _rows((50, 4), (54, 4), (70, 4), (74, 4), (78, 2), (80, 6), (86, 4))
    # Breaks: row 2 (remote jumps), row 4 (local jumps), row 6 (local jumps).
    out = coalesce(local, remote)
    np.testing.assert_array_equal(out.local, [[0, 8], [8, 8], [100, 8], [200, 4]])
    np.testing.assert_array_equal(out.remote, [[50, 8], [70, 8], [78, 8], [86, 4]])
    assert (out.before, out.after) == (7, 4)
    assert out.local[:, 1].sum() == local[:, 1].sum() == out.remote[:, 1].sum()


def test_backwards_blocks_do_not_merge() -> None:
    # Blocks [1, 0]: adjacent in memory but in reverse order, so no run.
    out = coalesce(_rows((8, 8), (0, 8)), _rows((8, 8), (0, 8)))
    assert out.after == 2


def test_device_change_breaks_a_run_and_is_kept() -> None:
    local = np.array([[0, 4, 0], [4, 4, 0], [8, 4, 1]], dtype=np.int64)
    remote = np.array([[0, 4, 3], [4, 4, 3], [8, 4, 3]], dtype=np.int64)
    out = coalesce(local, remote)
    np.testing.assert_array_equal(out.local, [[0, 8, 0], [8, 4, 1]])
    np.testing.assert_array_equal(out.remote, [[0, 8, 3], [8, 4, 3]])


def test_inputs_are_not_modified_and_empty_is_fine() -> None:
    local = _rows((0, 4), (4, 4))
    coalesce(local, local.copy())
    np.testing.assert_array_equal(local, [[0, 4], [4, 4]])
    out = coalesce([], [])
    assert (out.before, out.after) == (0, 0) and out.local.shape == (0, 3)


@pytest.mark.parametrize(
    ("local", "remote", "message"),
    [
        (_rows((0, 4)), _rows((0, 4), (4, 4)), "1 local rows cannot pair with 2 remote rows"),
        (_rows((0, 4), (4, 4)), _rows((0, 4), (4, 5)), "row 1 is 4 bytes locally and 5 bytes"),
        (_rows((0, 0)), _rows((0, 0)), "lengths must be positive"),
        (np.zeros((2, 4), dtype=np.int64), _rows((0, 4), (4, 4)), r"shape \(n, 2\) or \(n, 3\)"),
        (np.zeros((1, 2)), _rows((0, 4)), "must be integers"),
    ],
)
def test_bad_rows_raise(
    local: npt.NDArray[np.int64], remote: npt.NDArray[np.int64], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        coalesce(local, remote)


def _byte_pairs(
    local: npt.NDArray[np.int64], remote: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Every (local byte, remote byte) a transfer of these rows moves, in order."""
    lengths = local[:, 1]
    within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.stack(
        [np.repeat(local[:, 0], lengths) + within, np.repeat(remote[:, 0], lengths) + within],
        axis=1,
    )


# Each row: its length, and how far each side's address moves from the end of the previous row
# (0 = contiguous, which the strategy favours so that runs form; negative = jump back).
_step = st.one_of(st.just(0), st.integers(-64, 64))
_row = st.tuples(st.integers(1, 16), _step, _step)


@given(st.lists(_row, max_size=40))
def test_coalescing_preserves_the_byte_mapping(spec: list[tuple[int, int, int]]) -> None:
    lengths = np.array([n for n, _, _ in spec], dtype=np.int64)
    ends = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    local = np.stack(
        [1000 + ends + np.cumsum([d for _, d, _ in spec], dtype=np.int64), lengths], axis=1
    )
    remote = np.stack(
        [5000 + ends + np.cumsum([d for _, _, d in spec], dtype=np.int64), lengths], axis=1
    )
    local, remote = local.reshape(-1, 2), remote.reshape(-1, 2)
    out = coalesce(local, remote)
    np.testing.assert_array_equal(_byte_pairs(out.local, out.remote), _byte_pairs(local, remote))
    assert out.before == len(spec) and out.after <= out.before
    assert out.local[:, 1].sum() == lengths.sum()
    # Maximal: no two consecutive merged rows could still merge.
    if out.after > 1:
        ends_l = out.local[:-1, 0] + out.local[:-1, 1]
        ends_r = out.remote[:-1, 0] + out.remote[:-1, 1]
        assert not np.any((out.local[1:, 0] == ends_l) & (out.remote[1:, 0] == ends_r))
