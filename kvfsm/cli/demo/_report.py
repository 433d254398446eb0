"""What a demo run reports, on either fabric: `DemoReport` (`--json` prints it) and its figures."""

from __future__ import annotations

from collections import Counter, defaultdict

import msgspec

from kvfsm.runtime import time_in_state as request_time_in_state

__all__ = ["DemoReport", "time_in_state", "worst_state"]


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

    @property
    def ok(self) -> bool:
        """Every request done, every byte verified, no property broken."""
        return self.verified and not self.violations and self.done == self.requests


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
