"""Per-request metrics an engine keeps while a request lives, and the trace it reports at the end."""

from __future__ import annotations

import itertools

import msgspec

from kvfsm.core import Finished
from kvfsm.fabric import XferTelemetry

__all__ = ["RequestTrace", "TransferStats", "time_in_state", "trace_of"]


class TransferStats(msgspec.Struct, gc=False):
    """What one request's transfers did on one engine rank so far."""

    transfers: int = 0
    """Transfers posted (or completion notifications sent in place of one: replicated KV)."""
    failed: int = 0
    bytes: int = 0
    """Bytes of the transfers that completed."""
    descriptors: int = 0
    """Descriptor rows kvfsm posted."""
    fabric_descriptors: int = 0
    """Rows the fabric moved after merging adjacent ones (0 without fabric telemetry)."""
    post_us: float = 0.0
    """The fabric's time posting (telemetry)."""
    xfer_us: float = 0.0
    """The fabric's time from post to completion, summed over transfers (telemetry)."""

    def measured(self, telemetry: XferTelemetry | None) -> None:
        """Add the fabric's measurement of one finished transfer."""
        if telemetry is not None:
            self.fabric_descriptors += telemetry.descriptors
            self.post_us += telemetry.post_us
            self.xfer_us += telemetry.xfer_us


class RequestTrace(msgspec.Struct, frozen=True, kw_only=True):
    """One request's life on one engine rank, reported right after its `Finished`."""

    request_id: str
    state: str
    """The terminal state."""
    history: tuple[tuple[str, str, float], ...]
    """(event, state entered, time), as the core recorded it (empty with tracing off)."""
    time_in_state_s: dict[str, float]
    stats: TransferStats


def time_in_state(history: tuple[tuple[str, str, float], ...]) -> dict[str, float]:
    """Seconds spent in each non-terminal state of one history."""
    spent: dict[str, float] = {}
    for (_, state, start), (_, _, end) in itertools.pairwise(history):
        spent[state] = spent.get(state, 0.0) + (end - start)
    return spent


def trace_of(finished: Finished, stats: TransferStats | None) -> RequestTrace:
    """The trace of a request that just ended."""
    return RequestTrace(
        request_id=finished.request_id,
        state=finished.state,
        history=finished.history,
        time_in_state_s=time_in_state(finished.history),
        stats=stats or TransferStats(),
    )
