"""Settings of the core: deadlines and bounds, with the reasons for their defaults."""

from __future__ import annotations

import functools
import zlib
from typing import Literal

import msgspec

__all__ = [
    "CoreConfig",
    "Identity",
    "Mode",
    "Verify",
    "agent_name",
    "check_tp_sizes",
    "paired_ranks",
]

Mode = Literal["push", "pull"]
Verify = Literal["off", "sample", "all"]
_SAMPLE_ONE_IN = 8


class Identity(msgspec.Struct, frozen=True):
    """Who a local engine is: its engine id, TP rank and TP size, and where its side channel
    listens ("host:port"; D sends it with its registrations so P can handshake back)."""

    engine_id: str
    rank: int = 0
    tp_size: int = 1
    contact: str = ""

    @property
    def agent(self) -> str:
        """This engine rank's agent name on the fabric."""
        return agent_name(self.engine_id, self.rank)


class CoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Deadlines (seconds) and bounds. Every wait in kvfsm ends at one of these."""

    lease_s: float = 30.0
    """P holds finished blocks this long for a D that has not registered (heartbeats renew it)."""
    watchdog_s: float = 30.0
    """D waits this long for P to act on its registration (P's progress renews it)."""
    stall_s: float = 10.0
    """D gives up on (and cancels) in-flight transfers after this long without completion."""
    producer_stall_s: float = 20.0
    """P gives up on transfers it granted or posted; longer than `stall_s` so D's own cancel comes first."""
    fence_s: float = 30.0
    """D holds blocks of a request it gave up on this long at most, waiting for P's acknowledgement."""
    transport_drain_s: float | None = None
    """How long a transfer D gave up on may still land after its handle was released: D holds
    the blocks of a request that ended unreceived this long before handing them back. None: what
    the fabric reports (the runtime's `Engine` sets it; 0 where releasing a handle stops the
    transfer, UCX_TCP_USER_TIMEOUT plus slack on UCX's TCP transport). A value below the
    fabric's bound is refused."""
    heartbeat_s: float = 5.0
    """D tells P it still waits this often (must be well under `lease_s`)."""
    peer_idle_ttl_s: float = 600.0
    """A connected peer no live request used for this long (up to 1.5x: swept every half TTL) is
    evicted: its NIXL agent and prepared lists released; the next request handshakes again."""
    status_query_s: float = 5.0
    """How long before its bound a side that has not heard a transfer's completion asks the
    peer over the side channel what became of it: D before its watchdog (push), P before its
    stall bound (pull). A completion is a best-effort notification; the answer saves a transfer
    that finished. At most half the bound before it (short test bounds); 0: never ask (the
    bound decides, as without a side channel)."""
    pending_registration_ttl_s: float = 30.0
    """P keeps a registration for a request it does not know yet this long."""
    max_pending_registrations: int = 65536
    """P refuses registrations beyond this many unmatched ones (bounded memory)."""
    tombstones: int = 16384
    """How many finished request ids are remembered, to tell late messages from unknown ones."""
    trace: bool = True
    """Keep each request's transition history (state, event, time)."""
    verify: Verify = "off"
    """Check KV end to end: P sends a checksum of each transfer's bytes with its completion
    (push) or grant (pull), and D checks its blocks against it before it reports them received;
    a mismatch fails the request with its blocks invalid (`corrupted`). `sample`: one request in
    8 (by a hash of P's request id), `all`: every one. D checks whatever checksum comes while
    its own setting is not `off` (docs/runtime.md, "Integrity")."""

    @property
    def longest_wait_s(self) -> float:
        """The longest any one wait of a request lasts before a deadline ends it: a message
        that trails a later one from its sender by more than this concerns a request whose
        sides have moved on."""
        return max(self.lease_s, self.watchdog_s, self.stall_s, self.producer_stall_s, self.fence_s)

    def checksums(self, request_id: str) -> bool:
        """Whether P sends a checksum for this request (see `verify`)."""
        if self.verify == "all":
            return True
        return self.verify == "sample" and zlib.crc32(request_id.encode()) % _SAMPLE_ONE_IN == 0

    def ask_margin(self, bound_s: float) -> float | None:
        """How long before a bound of `bound_s` the peer is asked (None: never; see
        `status_query_s`)."""
        if self.status_query_s <= 0:
            return None
        return min(self.status_query_s, bound_s / 2)

    def __post_init__(self) -> None:
        checks = [
            (self.producer_stall_s > self.stall_s, "producer_stall_s must exceed stall_s"),
            (self.heartbeat_s < self.lease_s, "heartbeat_s must be below lease_s"),
            (
                min(self.lease_s, self.watchdog_s, self.stall_s, self.fence_s, self.peer_idle_ttl_s)
                > 0,
                "bounds > 0",
            ),
            (self.max_pending_registrations > 0 and self.tombstones > 0, "sizes must be > 0"),
            (self.transport_drain_s is None or self.transport_drain_s >= 0, "drain >= 0"),
            (self.status_query_s >= 0, "status_query_s >= 0"),
        ]
        problems = [msg for ok, msg in checks if not ok]
        if problems:
            raise ValueError("invalid CoreConfig: " + "; ".join(problems))


def agent_name(engine_id: str, rank: int) -> str:
    """The fabric agent name of one engine rank."""
    return f"{engine_id}#{rank}"


@functools.cache
def check_tp_sizes(tp_size: int, peer_tp_size: int) -> None:
    """ValueError unless one side's TP size divides the other's: the engines' one rule for which
    TP sizes can pair (a rank then exchanges KV with whole ranks of the peer)."""
    if tp_size < 1 or peer_tp_size < 1 or max(tp_size, peer_tp_size) % min(tp_size, peer_tp_size):
        raise ValueError(f"TP sizes {tp_size} (ours) and {peer_tp_size} (the peer's) do not divide")


def paired_ranks(rank: int, tp_size: int, peer_tp_size: int) -> range:
    """The peer ranks a rank exchanges KV with: several when the peer has more ranks (each holds a
    slice of this rank's heads), else the one peer rank holding this rank's heads."""
    if tp_size < 1 or peer_tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"bad TP geometry: rank {rank} of {tp_size}, peer TP {peer_tp_size}")
    check_tp_sizes(tp_size, peer_tp_size)
    if peer_tp_size >= tp_size:
        k = peer_tp_size // tp_size
        return range(rank * k, rank * k + k)
    first = rank // (tp_size // peer_tp_size)
    return range(first, first + 1)
