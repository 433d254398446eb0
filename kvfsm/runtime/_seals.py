"""An engine's notifications under the deployment's shared secret: each sent one sealed with
this incarnation's epoch and a per-peer sequence number, each received one opened, its tag
checked and refused if taken before (docs/security.md)."""

from __future__ import annotations

import time
from collections import Counter

from kvfsm.wire import GAP_TTL_S, AuthError, ReplayGuard, SharedSecret, is_sealed

__all__ = ["Seals", "new_epoch"]

_last_epoch = 0


def new_epoch() -> int:
    """An epoch for a new sender incarnation: later than any before it in this process, and
    (from the wall clock, in ns) than those of an earlier process on the host."""
    global _last_epoch
    _last_epoch = max(time.time_ns(), _last_epoch + 1)
    return _last_epoch


class Seals:
    """Seals and opens the notifications of agent `agent` in its incarnation `epoch` (0: a new
    one); without a secret, passes them through and drops sealed ones (the sender holds a
    secret this engine was not given). A number is taken once, however late it comes within
    `gap_ttl_s` of a later one (`ReplayGuard`).
    Refusals are counted in `counters`: `unauthenticated`, `replayed`."""

    def __init__(
        self,
        agent: str,
        secret: SharedSecret | None,
        counters: Counter[str],
        epoch: int = 0,
        gap_ttl_s: float = GAP_TTL_S,
    ) -> None:
        self._agent = agent
        self._secret = secret
        self._counters = counters
        self._epoch = epoch or new_epoch()  # this incarnation's, in every notification it seals
        self._sent: Counter[str] = Counter()  # per peer: notifications sealed
        self._replays = ReplayGuard(gap_ttl_s=gap_ttl_s)

    def seal(self, peer: str, payload: bytes) -> bytes:
        """`payload` as sent to `peer`."""
        if self._secret is None:
            return payload
        self._sent[peer] += 1
        return self._secret.seal(self._agent, peer, payload, self._epoch, self._sent[peer])

    def open(self, sender: str, data: bytes, now: float = 0.0) -> bytes | None:
        """The message in `data` from `sender`, or None if it is refused (and counted). `now`:
        the engine's clock."""
        if self._secret is None:
            if is_sealed(data):
                self._counters["unauthenticated"] += 1
                return None
            return data
        try:
            opened = self._secret.open(sender, self._agent, data)
        except AuthError:
            self._counters["unauthenticated"] += 1
            return None
        if self._replays.check(sender, opened.epoch, opened.seq, now) is not None:
            self._counters["replayed"] += 1
            return None
        return opened.payload
