"""What a demo run reports, on either fabric: `DemoReport` (`--json` prints it) and its figures."""

from __future__ import annotations

from collections import Counter, defaultdict

import msgspec

from kvfsm.runtime import time_in_state as request_time_in_state

__all__ = ["DemoReport", "time_in_state", "why_not_done", "worst_state"]

# Counters of volume, not of trouble: left out of the reasons a run did not end `done`.
_VOLUME = frozenset({"bytes", "descriptors", "posted", "peers_removed", "goodbyes", "verified"})
"""Counters of normal work, left out of `why_not_done`."""


class DemoReport(msgspec.Struct, kw_only=True):
    """What a demo run did; `--json` prints it."""

    mode: str
    fabric: str
    requests: int
    done: int
    failed: int
    expired: int
    aborted: int
    bytes: int
    verified: bool
    violations: list[str]
    p_tp: int
    d_tp: int
    finals: dict[str, int]
    time_in_state_ms: dict[str, dict[str, float]]
    counters: dict[str, int]
    simulated_s: float
    cpu_s: float
    wall_s: float = 0.0
    gbps: float = 0.0
    handoff_ms_p50: float = 0.0
    handoff_ms_p99: float = 0.0
    model: str = ""
    p_block_size: int = 0
    d_block_size: int = 0
    descriptors: int = 0
    """Descriptor rows kvfsm posted, over every rank."""
    fabric_descriptors: int = 0
    """Rows NIXL moved after merging those adjacent on both sides (its telemetry)."""
    why_not_done: list[str] = msgspec.field(default_factory=list)
    """Why the run failed, in lines a person reads (`why_not_done`); empty when it passed."""

    @property
    def ok(self) -> bool:
        """Every request done on every rank of both sides, every byte verified, no property
        broken."""
        return (
            self.verified
            and not self.violations
            and self.done == self.requests
            and all(key.endswith(":done") for key in self.finals)
        )


def why_not_done(report: DemoReport) -> list[str]:
    """Why `report` is not `ok`: the requests that did not end `done` on each side, the bytes
    not verified, and the engines' counters behind it (the volume ones left out)."""
    if report.ok:
        return []
    lines = [
        f"{count} request(s) ended {key.split(':')[1]} on {key.split(':')[0]}"
        for key, count in sorted(report.finals.items())
        if not key.endswith(":done")
    ]
    if report.done < report.requests:
        lines.append(f"{report.requests - report.done} of {report.requests} requests not done")
    if not report.verified:
        lines.append("not every byte was verified equal")
    if report.violations:
        lines.append(f"{len(report.violations)} safety violation(s)")
    trouble = {k: v for k, v in sorted(report.counters.items()) if k not in _VOLUME and v}
    if trouble:
        lines.append("counters: " + ", ".join(f"{k} {v}" for k, v in trouble.items()))
    return lines


def worst_state(states: set[str]) -> str:
    """How a request ended over several ranks: the worst of their terminal states."""
    for state in ("failed", "expired", "aborted"):
        if state in states:
            return state
    return "done" if states == {"done"} else "unfinished"


def time_in_state(
    histories: list[tuple[str, tuple[tuple[str, str, float], ...]]],
) -> dict[str, dict[str, float]]:
    """Mean milliseconds spent in each state, per side, from request histories."""
    total: defaultdict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))
    seen: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for side, history in histories:
        for state, seconds in request_time_in_state(history).items():
            total[side][state] += seconds * 1e3
            seen[side][state] += 1
    return {
        side: {state: round(total[side][state] / seen[side][state], 3) for state in total[side]}
        for side in sorted(total)
    }
