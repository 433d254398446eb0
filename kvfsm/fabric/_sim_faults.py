"""The simulated fabric's fault knobs (`SimFaults`), its counters (`SimStats`) and its dice.

Everything random goes through one `_Dice`, which owns the network's only `random.Random` and
the scripted one-shot injections. A knob set to 0 draws nothing, so turning one fault on does not
change the draws other faults see elsewhere. The clock and event heap that apply them are in
`_sim_clock`.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Literal

__all__ = ["POST_OUTCOMES", "PostOutcome", "SimFaults", "SimStats"]

PostOutcome = Literal["fail_post", "err", "stuck", "delay"]
"""A scripted outcome for one `transfer()` call (see `SimNetwork.inject_next_post`)."""

POST_OUTCOMES: tuple[PostOutcome, ...] = ("fail_post", "err", "stuck", "delay")

_PROBABILITIES = (
    "drop_notif",
    "duplicate_notif",
    "delay_notif",
    "reorder_notif",
    "fail_post",
    "xfer_err",
    "xfer_stuck",
)

MIN_DELAYED_POST = 1e-3
"""A post scripted as ``"delay"`` completes after ``max(transfer_latency, MIN_DELAYED_POST)``."""


@dataclass(frozen=True, slots=True)
class SimFaults:
    """Probabilistic faults and latencies of a `SimNetwork`; every fault defaults to off.

    Probabilities are per event: per notification sent (``*_notif``) or per `transfer()` call
    (``fail_post``, ``xfer_err``, ``xfer_stuck``; checked in that order, the first hit wins).
    Latencies are in virtual seconds.
    """

    drop_notif: float = 0.0
    """A notification is lost."""
    duplicate_notif: float = 0.0
    """A notification is delivered twice (the copy right after the original)."""
    delay_notif: float = 0.0
    """A notification arrives up to ``max_notif_delay`` (uniform) later than ``notif_latency``."""
    reorder_notif: float = 0.0
    """A notification overtakes the latest earlier undelivered one to the same receiver."""
    fail_post: float = 0.0
    """`transfer()` raises `FabricError`; the handle keeps its previous state."""
    xfer_err: float = 0.0
    """The transfer ends ``"ERR"`` after copying a random prefix of its rows; no notification."""
    xfer_stuck: float = 0.0
    """The transfer stays ``"PROC"`` forever (until released)."""
    notif_latency: float = 1e-4
    """Delivery delay of every notification; positive, so a transfer's notification always
    arrives strictly after the initiator could see ``"DONE"``."""
    transfer_latency: float = 0.0
    """0: transfers complete inside `transfer()`; otherwise they complete this much later."""
    max_notif_delay: float = 1e-3
    """Upper bound of the extra delay drawn for ``delay_notif``."""
    late_delivery: float = 0.0
    """0: releasing a transfer in progress cancels it. Otherwise its bytes still land this much
    later, without a notification, if both agents are live and the link is not cut then (UCX
    over TCP: bytes already in a kernel socket arrive when the link allows, until the kernel
    gives the connection up). `SimFabric.late_delivery_s` reports it."""

    def __post_init__(self) -> None:
        for name in _PROBABILITIES:
            p = getattr(self, name)
            if not (isinstance(p, int | float) and 0.0 <= p <= 1.0):
                raise ValueError(f"SimFaults.{name} must be a probability in [0, 1], got {p!r}")
        if not (math.isfinite(self.notif_latency) and self.notif_latency > 0):
            raise ValueError(f"SimFaults.notif_latency must be > 0, got {self.notif_latency!r}")
        for name in ("transfer_latency", "max_notif_delay", "late_delivery"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"SimFaults.{name} must be finite and >= 0, got {v!r}")


@dataclass(slots=True)
class SimStats:
    """Counters of a `SimNetwork`, for assertions and invariants.

    Notifications balance: ``notifs_sent + notifs_duplicated == notifs_delivered +
    notifs_dropped + network.pending_notifs()``. A notification that vanishes because its
    receiver (or its silently killed sender) is dead counts as dropped. ``bytes_moved`` counts
    the bytes of transfers that ended ``"DONE"`` only; ``posts`` includes failed posts.
    """

    notifs_sent: int = 0
    notifs_delivered: int = 0
    notifs_dropped: int = 0
    notifs_duplicated: int = 0
    posts: int = 0
    posts_failed: int = 0
    xfers_done: int = 0
    xfers_err: int = 0
    xfers_cancelled: int = 0
    bytes_moved: int = 0
    late_bytes: int = 0


@dataclass(frozen=True, slots=True)
class _NotifPlan:
    """What happens to one notification: dropped, duplicated, delayed, reordered."""

    drop: bool = False
    duplicate: bool = False
    extra_delay: float = 0.0
    reorder: bool = False


_NotifAction = Literal["drop", "duplicate"] | float  # a float: extra delay in seconds


class _Dice:
    """The network's seeded randomness plus its one-shot scripted injections."""

    def __init__(self, seed: int, faults: SimFaults) -> None:
        self._rng = random.Random(seed)
        self._faults = faults
        self._posts: dict[str, deque[PostOutcome]] = {}
        self._notifs: dict[str, deque[_NotifAction]] = {}

    def _hit(self, p: float) -> bool:
        # No draw at p == 0: enabling one knob leaves the other knobs' draws unchanged.
        return p > 0 and self._rng.random() < p

    def script_post(self, agent: str, outcome: PostOutcome) -> None:
        """Queue an outcome for `agent`'s next `transfer()` (FIFO)."""
        self._posts.setdefault(agent, deque()).append(outcome)

    def scripted_posts(self) -> dict[str, deque[PostOutcome]]:
        """The outcomes queued per agent, next first."""
        return self._posts

    def script_notif(self, receiver: str, action: _NotifAction) -> None:
        """Queue an action for the next notification sent to `receiver` (FIFO)."""
        self._notifs.setdefault(receiver, deque()).append(action)

    def post_outcome(self, agent: str) -> Literal["ok", "fail_post", "err", "stuck", "delay"]:
        """Outcome of one `transfer()` by `agent`: scripted if queued, else drawn."""
        queued = self._posts.get(agent)
        if queued:
            return queued.popleft()
        f = self._faults
        if self._hit(f.fail_post):
            return "fail_post"
        if self._hit(f.xfer_err):
            return "err"
        if self._hit(f.xfer_stuck):
            return "stuck"
        return "ok"

    def partial_rows(self, n: int) -> int:
        """How many rows (of `n`) a failing transfer copies before it fails: fewer than all."""
        return self._rng.randrange(n) if n > 0 else 0

    def notif_plan(self, receiver: str) -> _NotifPlan:
        """Fate of one notification to `receiver`: scripted if queued, else drawn."""
        queued = self._notifs.get(receiver)
        if queued:
            action = queued.popleft()
            if action == "drop":
                return _NotifPlan(drop=True)
            if action == "duplicate":
                return _NotifPlan(duplicate=True)
            return _NotifPlan(extra_delay=float(action))
        f = self._faults
        if self._hit(f.drop_notif):
            return _NotifPlan(drop=True)
        duplicate = self._hit(f.duplicate_notif)
        extra = self._rng.uniform(0.0, f.max_notif_delay) if self._hit(f.delay_notif) else 0.0
        return _NotifPlan(
            duplicate=duplicate, extra_delay=extra, reorder=self._hit(f.reorder_notif)
        )
