"""The engine loop's poll interval (`_Backoff`): hot for a while after activity, then backing
off; checked on explicit instants, no clock involved."""

from __future__ import annotations

import pytest

from kvfsm.runtime._loop import _Backoff

_MIN, _MAX = 20e-6, 1e-3


def test_activity_polls_again_at_the_minimum() -> None:
    backoff = _Backoff(_MIN, _MAX, hot_s=0.0)
    assert backoff.next(True, now=5.0) == _MIN


def test_without_a_hot_window_quiet_polls_double_up_to_the_maximum() -> None:
    backoff = _Backoff(_MIN, _MAX, hot_s=0.0)
    backoff.next(True, now=0.0)
    delays = [backoff.next(False, now=1e-3 * (i + 1)) for i in range(8)]
    assert delays[:3] == pytest.approx([2 * _MIN, 4 * _MIN, 8 * _MIN])
    assert delays == sorted(delays) and delays[-1] == _MAX


def test_the_hot_window_keeps_the_minimum_after_the_last_activity() -> None:
    backoff = _Backoff(_MIN, _MAX, hot_s=1e-3)
    backoff.next(True, now=10.0)
    # Quiet polls inside the window stay at the minimum: the hand-off's next message is due.
    assert [backoff.next(False, now=10.0 + t) for t in (1e-4, 5e-4, 1e-3)] == [_MIN] * 3
    # Past it, the back-off resumes from the minimum.
    assert backoff.next(False, now=10.002) == 2 * _MIN
    assert backoff.next(False, now=10.003) == 4 * _MIN
    # New activity restarts the window.
    assert backoff.next(True, now=11.0) == _MIN
    assert backoff.next(False, now=11.0005) == _MIN


def test_before_any_activity_the_loop_backs_off() -> None:
    backoff = _Backoff(_MIN, _MAX, hot_s=1.0)
    assert backoff.next(False, now=0.0) == 2 * _MIN
