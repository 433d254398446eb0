"""The engine: feeds one side of the core with events and executes its commands on a fabric.

It owns the fabric (every fabric call happens inside `submit`/`poll`, from one thread), turns
notifications, transfer states and handshake results into events, and hands the caller the
commands that concern it (blocks released, requests received or failed, requests finished).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from kvfsm.core import (
    CancelTransfer,
    Command,
    Event,
    Finished,
    HandshakeDone,
    HandshakeFailed,
    NotificationReceived,
    PeerLost,
    PostTransfer,
    ReleaseBlocks,
    RemoveAgent,
    ReportFailed,
    ReportReceived,
    SendNotification,
    Side,
    StartHandshake,
    Tick,
    TransferResult,
)
from kvfsm.fabric import Fabric, FabricError, RemoteDisconnectedError, XferHandle
from kvfsm.layout import BlockLayout
from kvfsm.wire import BlockIds

__all__ = ["CallerOutput", "Directory", "Engine", "HandshakeError", "InFlight", "PeerInfo"]

CallerOutput = ReleaseBlocks | ReportReceived | ReportFailed | Finished


class PeerInfo(msgspec.Struct, frozen=True):
    """What a handshake learns about a peer rank: its agent and where its blocks are."""

    agent: str
    metadata: bytes
    base_address: int
    layout: BlockLayout


class HandshakeError(Exception):
    """A handshake failed; the message says why."""


class Directory(Protocol):
    """How an engine reaches its peers' handshake information (asynchronously: a real side channel
    runs handshakes off the engine's thread)."""

    def start(self, peer: str) -> None:
        """Begin a handshake with `peer`."""
        ...

    def results(self) -> list[tuple[str, PeerInfo | HandshakeError]]:
        """Handshakes finished since the last call: the peer's information or why it failed."""
        ...


class InFlight(msgspec.Struct):
    """A posted transfer: what it moves, to be checked until it ends."""

    request_id: str
    handle: XferHandle
    peer: str
    op: str
    local_blocks: BlockIds
    remote_blocks: BlockIds


class Engine:
    """One engine rank: a core side, a fabric agent and the KV region it registered."""

    def __init__(
        self,
        side: Side,
        fabric: Fabric,
        kv: npt.NDArray[np.uint8],
        layout: BlockLayout,
        directory: Directory,
        clock: Callable[[], float],
    ) -> None:
        if kv.nbytes != layout.nbytes:
            raise ValueError(f"KV buffer has {kv.nbytes} bytes, layout needs {layout.nbytes}")
        self.side = side
        self.fabric = fabric
        self.kv = kv
        self.layout = layout
        self.directory = directory
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self.outputs: list[CallerOutput] = []
        self.inflight: dict[int, InFlight] = {}
        self._memory = fabric.register_memory(kv)
        self._local = fabric.prep_xfer_dlist(None, layout.descriptors(int(kv.ctypes.data)))
        self._remote: dict[str, int] = {}  # peer agent -> prepared remote list
        self._queue: deque[Event] = deque()
        self._closed = False
        self._runners: dict[type, Callable[[Any], None]] = {
            PostTransfer: self._post,
            SendNotification: self._notify,
            CancelTransfer: lambda c: self._cancel(c.transfer_id),
            StartHandshake: lambda c: self.directory.start(c.peer),
            RemoveAgent: lambda c: self._forget_peer(c.peer),
        }

    @property
    def agent(self) -> str:
        """This engine's agent name."""
        return self.fabric.agent_name

    def info(self) -> PeerInfo:
        """What a peer's handshake with this engine returns."""
        meta = self.fabric.get_agent_metadata()
        return PeerInfo(self.agent, meta, int(self.kv.ctypes.data), self.layout)

    # --- driving -------------------------------------------------------------------------------

    def submit(self, event: Event) -> None:
        """Feed one event, and every event its commands cause, through the core."""
        queue = self._queue
        queue.append(event)
        while queue:
            for command in self.side.handle(queue.popleft(), self.clock()):
                self._execute(command)

    def poll(self) -> None:
        """Drain notifications, check in-flight transfers and fire due deadlines."""
        for peer, result in self.directory.results():
            self._connect(peer, result)
        for sender, messages in self._notifications().items():
            for payload in messages:
                self.submit(NotificationReceived(sender, payload))
        for tid, flight in list(self.inflight.items()):
            self._check(tid, flight)
        self.submit(Tick())  # also runs the results queued by the checks

    def take_outputs(self) -> list[CallerOutput]:
        """The caller-facing commands since the last call."""
        out, self.outputs = self.outputs, []
        return out

    def close(self) -> None:
        """Release every handle, list, remote agent and the registration."""
        if self._closed:
            return
        self._closed = True
        with _tolerant(self.counters, "close"):
            for flight in self.inflight.values():
                self.fabric.release_xfer_handle(flight.handle)
            self.inflight.clear()
            for peer in list(self._remote):
                self._forget_peer(peer)
            self.fabric.release_dlist_handle(self._local)
            self.fabric.deregister_memory(self._memory)

    # --- executing commands ----------------------------------------------------------------------

    def _execute(self, command: Command) -> None:
        run = self._runners.get(type(command))
        if run is None:
            self.outputs.append(command)  # type: ignore[arg-type]  # a caller output
        else:
            run(command)

    def _connect(self, peer: str, result: PeerInfo | HandshakeError) -> None:
        try:
            if isinstance(result, HandshakeError):
                raise result
            info = result
            if info.agent != peer:
                raise HandshakeError(f"asked for {peer!r}, {info.agent!r} answered")
            self._forget_peer(peer)
            self.fabric.add_remote_agent(info.metadata)
            descs = info.layout.descriptors(info.base_address)
            self._remote[peer] = self.fabric.prep_xfer_dlist(peer, descs)
        except (HandshakeError, FabricError) as exc:
            self.counters["handshake_failed"] += 1
            self._queue.append(HandshakeFailed(peer, str(exc)))
            return
        self._queue.append(HandshakeDone(peer))

    def _forget_peer(self, peer: str) -> None:
        dlist = self._remote.pop(peer, None)
        if dlist is None:
            return
        with _tolerant(self.counters, "remove_agent"):
            self.fabric.release_dlist_handle(dlist)
            self.fabric.remove_remote_agent(peer)

    def _post(self, cmd: PostTransfer) -> None:
        dlist = self._remote.get(cmd.peer)
        if dlist is None:
            self._queue.append(TransferResult(cmd.request_id, cmd.transfer_id, False, "no peer"))
            return
        handle = None
        try:
            handle = self.fabric.make_prepped_xfer(
                cmd.op,
                self._local,
                cmd.local_blocks.astype(np.int64),
                dlist,
                cmd.remote_blocks.astype(np.int64),
                cmd.notification,
            )
            state = self.fabric.transfer(handle)
        except FabricError as exc:
            self._post_failed(cmd, handle, exc)
            return
        self.counters["posted"] += 1
        self.counters["blocks_posted"] += len(cmd.local_blocks)
        flight = InFlight(
            cmd.request_id, handle, cmd.peer, cmd.op, cmd.local_blocks, cmd.remote_blocks
        )
        self.inflight[cmd.transfer_id] = flight
        if state != "PROC":
            self._finish(cmd.transfer_id, flight, state == "DONE", state)

    def _post_failed(self, cmd: PostTransfer, handle: XferHandle | None, exc: Exception) -> None:
        self.counters["post_failed"] += 1
        if handle is not None:
            with _tolerant(self.counters, "release"):
                self.fabric.release_xfer_handle(handle)
        self._queue.append(TransferResult(cmd.request_id, cmd.transfer_id, False, str(exc)))
        if isinstance(exc, RemoteDisconnectedError):
            self._lost(cmd.peer)

    def _check(self, tid: int, flight: InFlight) -> None:
        try:
            state = self.fabric.check_xfer_state(flight.handle)
        except FabricError as exc:
            if isinstance(exc, RemoteDisconnectedError):
                self._lost(flight.peer)  # the cause first, then what it did to the transfer
            self._finish(tid, flight, False, str(exc))
            return
        if state != "PROC":
            self._finish(tid, flight, state == "DONE", state)

    def _finish(self, tid: int, flight: InFlight, ok: bool, why: str) -> None:
        del self.inflight[tid]
        with _tolerant(self.counters, "release"):
            self.fabric.release_xfer_handle(flight.handle)
        if ok:
            self.counters["bytes"] += len(flight.local_blocks) * self.layout.block_bytes
        self._queue.append(TransferResult(flight.request_id, tid, ok, "" if ok else why))

    def _cancel(self, tid: int) -> None:
        flight = self.inflight.pop(tid, None)
        if flight is not None:
            self.counters["cancelled"] += 1
            with _tolerant(self.counters, "release"):
                self.fabric.release_xfer_handle(flight.handle)

    def _notify(self, cmd: SendNotification) -> None:
        try:
            self.fabric.send_notif(cmd.peer, cmd.payload)
        except FabricError as exc:
            self.counters["notify_failed"] += 1
            if isinstance(exc, RemoteDisconnectedError):
                self._lost(cmd.peer)

    def _lost(self, peer: str) -> None:
        """Report a lost peer, unless its agent is no longer loaded (a stale transfer's error)."""
        if peer in self._remote:
            self._queue.append(PeerLost(peer))
        else:
            self.counters["stale_peer_lost"] += 1

    def _notifications(self) -> dict[str, list[bytes]]:
        try:
            return self.fabric.get_new_notifs()
        except FabricError:
            self.counters["notif_drain_failed"] += 1
            return {}


@contextmanager
def _tolerant(counters: Counter[str], what: str) -> Iterator[None]:
    """Count a fabric error during cleanup instead of letting it stop the cleanup."""
    try:
        yield
    except FabricError:
        counters[f"{what}_error"] += 1
