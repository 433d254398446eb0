"""The caller's input to the core is checked once, on entry, with a clear error."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.core import Admit, Consumer, Identity, PrefillFinished, Producer
from kvfsm.lifecycle import LocalProtocolError


@pytest.mark.parametrize(
    ("blocks", "error", "text"),
    [
        (np.array([[1, 2]]), TypeError, "1-D integer array"),
        (np.array(["a"]), TypeError, "1-D integer array"),
        (np.array([0.5]), TypeError, "1-D integer array"),
        (np.array([-1]), ValueError, r"\[0, 2\*\*31\)"),
        (np.array([2**40]), ValueError, r"\[0, 2\*\*31\)"),
    ],
)
def test_bad_block_ids_are_refused_and_nothing_is_kept(
    blocks: np.ndarray, error: type[Exception], text: str
) -> None:
    p = Producer(Identity("P"), "push")
    with pytest.raises(error, match=text):
        p.handle(Admit("r", blocks), 0.0)
    assert not p.requests
    p.handle(Admit("r", np.array([1, 2])), 0.0)  # the same id is still free
    with pytest.raises(error, match=text):
        p.handle(PrefillFinished("r", blocks), 0.0)
    assert p.requests["r"].state == "allocated"


def test_block_ids_of_any_integer_type_become_int32() -> None:
    d = Consumer(Identity("D"), "pull")
    d.handle(Admit("r", np.array([3, 4], dtype=np.int64), "P", 1, "p"), 0.0)
    assert d.requests["r"].blocks.dtype == np.int32


def test_admitting_twice_is_the_callers_protocol_error() -> None:
    p = Producer(Identity("P"), "pull")
    p.handle(Admit("r", np.array([1])), 0.0)
    with pytest.raises(LocalProtocolError, match="'admit' is not accepted") as caught:
        p.handle(Admit("r", np.array([1])), 0.0)
    assert caught.value.fault == "caller" and caught.value.request == "r"
