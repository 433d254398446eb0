"""A peer's clock against ours, from one handshake: how deadlines cross hosts."""

from __future__ import annotations

__all__ = ["clock_offset"]


def clock_offset(
    sent: float, peer_received: float, peer_sent: float, received: float
) -> tuple[float, float]:
    """A peer's clock minus ours, and the bound on its error, from one exchange (NTP's
    estimate): we sent at `sent` and got the answer at `received` (our clock); the peer got the
    request at `peer_received` and answered at `peer_sent` (its clock). The error is at most
    half the time the messages spent travelling, however long the peer held the request."""
    travel = (received - sent) - (peer_sent - peer_received)
    return ((peer_received - sent) + (peer_sent - received)) / 2, max(travel, 0.0) / 2
