"""What the connector reports to vLLM's stats loggers and Prometheus: requests by final state,
transfers, bytes, failures, expiries, bugs contained, and time spent in each lifecycle state."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvfsm.runtime import RequestTrace

__all__ = ["StatsWindow", "merge", "reduce"]

_COUNTS = (
    "transfers",
    "failed_transfers",
    "bytes",
    "descriptors",
    "internal_errors",
    "refused_notifications",
    "corrupted",
    "verified",
    "recovered",
    "goodbyes",
    "peers_removed",
)


_KEYS = ("ended", "counts", "seconds", "visits", "engines")


class StatsWindow:
    """Stats gathered on one worker rank between two `get_kv_connector_stats` calls."""

    def __init__(self) -> None:
        self.ended: Counter[str] = Counter()  # final state -> requests
        self.counts: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # state -> seconds, over requests
        self.visits: Counter[str] = Counter()  # state -> requests that spent time in it
        self.engines: Counter[str] = Counter()  # engine state (not serving) -> ranks in it

    @property
    def empty(self) -> bool:
        """Nothing ended and nothing went wrong in this window."""
        return not self.ended and not +self.counts and not self.engines

    def add(self, trace: RequestTrace) -> None:
        """Count one finished request."""
        self.ended[trace.state] += 1
        st = trace.stats
        self.counts.update(
            transfers=st.transfers,
            failed_transfers=st.failed,
            bytes=st.bytes,
            descriptors=st.descriptors,
        )
        self.seconds.update(trace.time_in_state_s)
        self.visits.update(trace.time_in_state_s.keys())

    def data(self) -> dict[str, Any]:
        """The serialisable form (plain dicts: it crosses from worker to logger process)."""
        return {
            "ended": dict(self.ended),
            "counts": dict(self.counts),
            "seconds": dict(self.seconds),
            "visits": dict(self.visits),
            "engines": dict(self.engines),
        }


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two windows' data as one (several ranks, or several steps)."""
    return {key: dict(Counter(a.get(key, {})) + Counter(b.get(key, {}))) for key in _KEYS}


def reduce(data: dict[str, Any]) -> dict[str, int | float]:
    """One line of figures for vLLM's periodic log."""
    ended, counts = data.get("ended", {}), data.get("counts", {})
    out: dict[str, int | float] = {
        "requests": sum(ended.values()),
        "done": ended.get("done", 0),
        "failed": ended.get("failed", 0),
        "expired": ended.get("expired", 0),
        "aborted": ended.get("aborted", 0),
    }
    out |= {name: counts.get(name, 0) for name in _COUNTS}
    out["MB"] = round(counts.get("bytes", 0) / 1e6, 3)
    if engines := data.get("engines"):
        out["drained"] = int(set(engines) == {"drained"})
    for state, seconds in sorted(data.get("seconds", {}).items()):
        visits = data.get("visits", {}).get(state, 0) or 1
        out[f"avg_ms_{state}"] = round(1e3 * seconds / visits, 3)
    return out
