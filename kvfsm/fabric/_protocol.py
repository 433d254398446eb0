"""The `Fabric` protocol: the subset of NIXL's agent API that kvfsm uses.

Both implementations (`SimFabric` and, later, `NixlFabric`) follow NIXL's semantics, quirks
included, so that code tested on the simulated fabric behaves the same on the real one:

* descriptors are rows ``(address, length, device_id)`` of an ``int64`` array of shape ``(n, 3)``;
* ``transfer`` may finish inside the call (returns ``"DONE"``), stay ``"PROC"``, or report
  ``"ERR"``; failures also arrive as typed exceptions (`RemoteDisconnectedError`, `RepostError`,
  `NotFoundError`);
* one active post per handle: re-posting a handle still in ``"PROC"`` raises `RepostError`;
* the notification attached to a transfer reaches the peer *after* the initiator sees ``"DONE"``;
* releasing a handle still in ``"PROC"`` cancels it (no byte lands afterwards);
* a silent peer can leave a transfer in ``"PROC"`` forever: there is no stall timeout in the fabric.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = [
    "DescArray",
    "DlistHandle",
    "Fabric",
    "FabricError",
    "MemoryHandle",
    "NotFoundError",
    "RemoteDisconnectedError",
    "RepostError",
    "XferHandle",
    "XferOp",
    "XferState",
    "XferTelemetry",
]

XferState = Literal["DONE", "PROC", "ERR"]
XferOp = Literal["WRITE", "READ"]
DescArray = npt.NDArray[np.int64]
"""Descriptor rows ``(address, length, device_id)``, shape ``(n, 3)``."""

MemoryHandle = int
DlistHandle = int
XferHandle = int


class XferTelemetry(NamedTuple):
    """What the fabric measured of one finished transfer."""

    post_us: float
    """Time spent posting it."""
    xfer_us: float
    """Time from the post to its completion."""
    bytes: int
    descriptors: int
    """Descriptors the fabric moved after merging those adjacent on both sides."""


class FabricError(Exception):
    """A fabric operation failed; the message says which and why."""


class RemoteDisconnectedError(FabricError):
    """The remote agent went away (NIXL_ERR_REMOTE_DISCONNECT)."""


class RepostError(FabricError):
    """A handle was posted again while its previous post is still in progress."""


class NotFoundError(FabricError):
    """An agent, handle or memory region is not known to this fabric."""


@runtime_checkable
class Fabric(Protocol):
    """One transfer agent: registered memory, remote agents, transfers and notifications."""

    @property
    def agent_name(self) -> str:
        """This agent's name, as peers see it in notifications."""
        ...

    @property
    def late_delivery_s(self) -> float:
        """How long after a transfer's handle is released its bytes may still land (0 where
        releasing stops it; `math.inf` where nothing bounds it)."""
        ...

    def register_memory(self, buffer: npt.NDArray[np.uint8]) -> MemoryHandle:
        """Register a contiguous byte buffer for transfers (DRAM)."""
        ...

    def deregister_memory(self, handle: MemoryHandle) -> None:
        """Deregister a buffer registered with `register_memory`."""
        ...

    def get_agent_metadata(self) -> bytes:
        """Opaque metadata a peer passes to `add_remote_agent`."""
        ...

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""
        ...

    def remove_remote_agent(self, agent: str) -> None:
        """Forget a peer and what was prepared for it."""
        ...

    def prep_xfer_dlist(self, agent: str | None, descs: DescArray) -> DlistHandle:
        """Prepare a descriptor list: local memory (``agent=None``) or a loaded remote agent's."""
        ...

    def release_dlist_handle(self, handle: DlistHandle) -> None:
        """Release a prepared descriptor list."""
        ...

    def make_prepped_xfer(
        self,
        op: XferOp,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int64],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int64],
        notif: bytes,
    ) -> XferHandle:
        """Create a transfer between rows of two prepared lists, with a completion notification."""
        ...

    def make_xfer(
        self, op: XferOp, local: DescArray, agent: str, remote: DescArray, notif: bytes
    ) -> XferHandle:
        """Create a transfer between descriptor rows given directly (no prepared lists; NIXL's
        `initialize_xfer`): local rows pair with the loaded peer `agent`'s rows, row for row.
        Unlike the prepped path, adjacent rows are not merged: the caller coalesces."""
        ...

    def transfer(self, handle: XferHandle) -> XferState:
        """Post a transfer. May complete inside the call."""
        ...

    def check_xfer_state(self, handle: XferHandle) -> XferState:
        """Progress and report a posted transfer."""
        ...

    def release_xfer_handle(self, handle: XferHandle) -> None:
        """Release a transfer; cancels it if still in progress."""
        ...

    def xfer_telemetry(self, handle: XferHandle) -> XferTelemetry | None:
        """What the fabric measured of a finished transfer (before its release); None if it
        does not measure."""
        ...

    def send_notif(self, agent: str, msg: bytes) -> None:
        """Send a notification to a loaded remote agent."""
        ...

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Drain notifications received since the last call, by sending agent."""
        ...

    def close(self) -> None:
        """Release everything this agent holds."""
        ...
