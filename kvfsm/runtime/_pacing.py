"""How the threads that poll a fabric pace themselves: `Backoff` (poll often right after
activity, then less and less) and `tighten_timer_slack` (short sleeps that end on time)."""

from __future__ import annotations

import contextlib
import ctypes
import sys

__all__ = ["Backoff", "tighten_timer_slack"]

_PR_SET_TIMERSLACK = 29
_TIMER_SLACK_NS = 1000


class Backoff:
    """The loop's poll interval: `poll_min_s` after activity and for `hot_s` after the last
    one, then doubling up to `poll_max_s`."""

    def __init__(self, poll_min_s: float, poll_max_s: float, hot_s: float) -> None:
        self.poll_min, self.poll_max, self.hot = poll_min_s, poll_max_s, hot_s
        self.delay = poll_min_s
        self._last_activity: float | None = None

    def next(self, activity: bool, now: float) -> float:
        """The interval until the next poll, after a poll at `now` that found `activity`."""
        if activity:
            self._last_activity = now
        last = self._last_activity
        if last is not None and now - last <= self.hot:
            self.delay = self.poll_min
        else:
            self.delay = min(2 * self.delay, self.poll_max)
        return self.delay


def tighten_timer_slack() -> None:
    """Ask Linux to wake this thread within 1 us of its timeouts (the default slack is 50 us);
    elsewhere, or where prctl is unavailable, keep the default."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0)
