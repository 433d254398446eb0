"""The sans-I/O core: P and D sides of every request, both modes. Events in, commands out.

No threads, sockets, NIXL, sleeps or wall clock here: time is an input to `handle`.
"""

from kvfsm.core._config import (
    CoreConfig,
    Identity,
    Mode,
    agent_name,
    check_tp_sizes,
    paired_ranks,
)
from kvfsm.core._consumer import Consumer, ProducerLink
from kvfsm.core._containment import short_trace
from kvfsm.core._dispatch import Deadlines, Step, StepFailed
from kvfsm.core._implemented import implementations
from kvfsm.core._io import (
    Abort,
    Admit,
    CancelTransfer,
    Command,
    CommandFailed,
    Drain,
    Event,
    Finished,
    HandshakeDone,
    HandshakeFailed,
    InternalError,
    NotificationReceived,
    PeerLost,
    PostTransfer,
    PrefillFinished,
    ReleaseBlocks,
    RemoveAgent,
    ReportFailed,
    ReportReceived,
    SendNotification,
    Shutdown,
    StartHandshake,
    Tick,
    TransferResult,
)
from kvfsm.core._producer import ConsumerLink, Producer
from kvfsm.core._records import EngineRecord, Peer, Request, TransferTally
from kvfsm.core._side import MAX_PEERS, Side, SideSnapshot
from kvfsm.core._tombstones import Tombstones

__all__ = [
    "MAX_PEERS",
    "Abort",
    "Admit",
    "CancelTransfer",
    "Command",
    "CommandFailed",
    "Consumer",
    "ConsumerLink",
    "CoreConfig",
    "Deadlines",
    "Drain",
    "EngineRecord",
    "Event",
    "Finished",
    "HandshakeDone",
    "HandshakeFailed",
    "Identity",
    "InternalError",
    "Mode",
    "NotificationReceived",
    "Peer",
    "PeerLost",
    "PostTransfer",
    "PrefillFinished",
    "Producer",
    "ProducerLink",
    "ReleaseBlocks",
    "RemoveAgent",
    "ReportFailed",
    "ReportReceived",
    "Request",
    "SendNotification",
    "Shutdown",
    "Side",
    "SideSnapshot",
    "StartHandshake",
    "Step",
    "StepFailed",
    "Tick",
    "Tombstones",
    "TransferResult",
    "TransferTally",
    "agent_name",
    "check_tp_sizes",
    "implementations",
    "paired_ranks",
    "short_trace",
]
