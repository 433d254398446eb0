"""The core's inputs (events) and outputs (commands). Time is not in them: `handle` takes `now`."""

from __future__ import annotations

from typing import Literal

import msgspec

from kvfsm.wire import BlockIds

__all__ = [
    "Abort",
    "Admit",
    "AskPeer",
    "BlocksVerified",
    "CancelTransfer",
    "Command",
    "CommandFailed",
    "Drain",
    "Event",
    "Finished",
    "HandshakeDone",
    "HandshakeFailed",
    "InternalError",
    "NotificationReceived",
    "PeerAnswered",
    "PeerLost",
    "PostTransfer",
    "PrefillFinished",
    "ReleaseBlocks",
    "RemoveAgent",
    "ReportFailed",
    "ReportReceived",
    "SendNotification",
    "Shutdown",
    "StartHandshake",
    "Tick",
    "TransferResult",
    "TransferStatus",
    "VerifyBlocks",
]

TransferStatus = Literal["done", "transferring", "waiting", "failed", "unknown", "unanswered"]
"""What a peer says of a transfer when asked (`AskPeer`): it completed; it is under way; nothing
was posted for it yet; it failed or the request ended without it (nothing of it can still
move); the peer never heard of the request; or no answer came (side channel down, timeout)."""


class _Io(msgspec.Struct, frozen=True, gc=False):
    pass


# --- events -----------------------------------------------------------------------------------


class Admit(_Io, frozen=True, gc=False):
    """The caller admits a request. P: `blocks` are allocated for the prefill. D: `blocks` are to be
    filled from P (empty on a full prefix-cache hit); `peer_engine`/`peer_tp` name P,
    `peer_request_id` is P's id for the request and `peer_contact` where P's side channel
    listens (from P's transfer params; "" if unknown)."""

    request_id: str
    blocks: BlockIds
    peer_engine: str = ""
    peer_tp: int = 1
    peer_request_id: str = ""
    peer_contact: str = ""


class PrefillFinished(_Io, frozen=True, gc=False):
    """P: the prefill finished; `blocks` are the request's final blocks (possibly none)."""

    request_id: str
    blocks: BlockIds


class Abort(_Io, frozen=True, gc=False):
    """The caller aborts a request."""

    request_id: str


class Drain(_Io, frozen=True, gc=False):
    """The engine drains: no new request or registration is taken, what is under way ends,
    and once nothing is live or held every connected peer is told goodbye (docs/lifecycles.md)."""


class Tick(_Io, frozen=True, gc=False):
    """Time passed: fire due deadlines and heartbeats."""


class Shutdown(_Io, frozen=True, gc=False):
    """The engine shuts down: every request ends, every peer closes."""


class NotificationReceived(_Io, frozen=True, gc=False):
    """A notification arrived from the agent `sender`."""

    sender: str
    payload: bytes


class HandshakeDone(_Io, frozen=True, gc=False):
    """The handshake with `peer` completed and its agent is loaded. `clock_offset` is the
    peer's clock minus ours, as the handshake measured it, within `clock_error` seconds: P and
    D on different hosts have unrelated monotonic clocks, and deadlines cross between them.
    `incarnation` is the process that answered (0: unknown)."""

    peer: str
    clock_offset: float = 0.0
    clock_error: float = 0.0
    incarnation: int = 0


class HandshakeFailed(_Io, frozen=True, gc=False):
    """The handshake with `peer` failed."""

    peer: str
    reason: str


class PeerLost(_Io, frozen=True, gc=False):
    """The fabric reported `peer` disconnected."""

    peer: str


class TransferResult(_Io, frozen=True, gc=False):
    """A posted transfer ended: DONE (`ok`), or ERR / failed to post."""

    request_id: str
    transfer_id: int
    ok: bool
    reason: str = ""


class PeerAnswered(_Io, frozen=True, gc=False):
    """`peer` answered (or did not: "unanswered") the question `AskPeer` asked about its
    transfer for our `request_id`."""

    peer: str
    request_id: str
    status: TransferStatus


class BlocksVerified(_Io, frozen=True, gc=False):
    """D: the bytes `peer`'s transfer left in the request's blocks did (`ok`) or did not match
    the checksum it sent (`VerifyBlocks`)."""

    request_id: str
    peer: str
    ok: bool


class CommandFailed(_Io, frozen=True, gc=False):
    """The runtime could not carry out a command for `request_id` (a bug: the fabric's faults
    come as `TransferResult` and `PeerLost`). The core abandons the request safely."""

    request_id: str
    detail: str


Event = (
    Admit
    | PrefillFinished
    | Abort
    | Tick
    | Shutdown
    | Drain
    | NotificationReceived
    | HandshakeDone
    | HandshakeFailed
    | PeerLost
    | TransferResult
    | PeerAnswered
    | BlocksVerified
    | CommandFailed
)

# --- commands ---------------------------------------------------------------------------------


class StartHandshake(_Io, frozen=True, gc=False):
    """Connect to `peer` (its side channel at `contact`, if one was learned), then feed back
    `HandshakeDone` or `HandshakeFailed`."""

    peer: str
    contact: str = ""


class RemoveAgent(_Io, frozen=True, gc=False):
    """Unload `peer`'s agent and everything prepared for it."""

    peer: str


class AskPeer(_Io, frozen=True, gc=False):
    """Ask `peer` over the side channel what became of its transfer for our `request_id` (its
    id for it: `peer_request_id`, "" if unknown), then feed back `PeerAnswered`. Bounded: no
    answer in time is an "unanswered"."""

    peer: str
    request_id: str
    peer_request_id: str = ""


class PostTransfer(_Io, frozen=True, gc=False):
    """Post a transfer between paired blocks; feed back `TransferResult`. With `checksum`, the
    runtime puts the checksum of the local bytes it moves into `notification` (a
    `Completion`) first."""

    request_id: str
    transfer_id: int
    op: Literal["WRITE", "READ"]
    peer: str
    local_blocks: BlockIds
    remote_blocks: BlockIds
    notification: bytes
    checksum: bool = False


class VerifyBlocks(_Io, frozen=True, gc=False):
    """D: compute the checksum of the local bytes `peer`'s transfer into `local_blocks` filled
    (paired with the peer's `remote_blocks`, as the transfer was), compare it with `expected`,
    and feed back `BlocksVerified`."""

    request_id: str
    peer: str
    expected: int
    local_blocks: BlockIds
    remote_blocks: BlockIds


class CancelTransfer(_Io, frozen=True, gc=False):
    """Release a posted transfer's handle; the fabric cancels what has not landed."""

    request_id: str
    transfer_id: int


class SendNotification(_Io, frozen=True, gc=False):
    """Send `payload` to `peer`. With `checksum_blocks` (local, remote), the runtime first puts
    into it (a `Grant`) the checksum of the local bytes those blocks select for the peer."""

    peer: str
    payload: bytes
    checksum_blocks: tuple[BlockIds, BlockIds] | None = None


class ReleaseBlocks(_Io, frozen=True, gc=False):
    """Hand `blocks` back to the caller's allocator."""

    request_id: str
    blocks: BlockIds


class ReportReceived(_Io, frozen=True, gc=False):
    """D: the request's `blocks` now hold P's KV; they belong to the caller again."""

    request_id: str
    blocks: BlockIds


class ReportFailed(_Io, frozen=True, gc=False):
    """D: the request failed; its `blocks` are invalid (to recompute or fail)."""

    request_id: str
    blocks: BlockIds


class Finished(_Io, frozen=True, gc=False):
    """The request reached the terminal `state`; the core holds nothing for it any more.
    `history` is its transitions, (event, state entered, time), when tracing is on."""

    request_id: str
    state: str
    history: tuple[tuple[str, str, float], ...] = ()


class InternalError(_Io, frozen=True, gc=False):
    """A bug was contained: `detail` says where and what, `trace` is the traceback. The
    requests it hit (`request_ids`) were abandoned safely: D's reported failed, blocks released
    once nothing can land in them; every other request goes on. For the caller to log and
    count."""

    detail: str
    request_ids: tuple[str, ...] = ()
    trace: str = ""


Command = (
    StartHandshake
    | RemoveAgent
    | AskPeer
    | VerifyBlocks
    | PostTransfer
    | CancelTransfer
    | SendNotification
    | ReleaseBlocks
    | ReportReceived
    | ReportFailed
    | Finished
    | InternalError
)
