"""The engine: feeds one side of the core with events and executes its commands on a fabric.

It owns the fabric (every fabric call happens inside `submit`/`poll`, from one thread), turns
notifications, transfer states and handshake results into events, and hands the caller the
commands that concern it (blocks released, requests received or failed, requests finished) and a
`RequestTrace` of each finished request.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import msgspec

from kvfsm.core import (
    AskPeer,
    BlocksVerified,
    CancelTransfer,
    Command,
    CommandFailed,
    Event,
    Finished,
    HandshakeDone,
    HandshakeFailed,
    InternalError,
    NotificationReceived,
    PeerAnswered,
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
    TransferStatus,
    VerifyBlocks,
    short_trace,
)
from kvfsm.fabric import Fabric, FabricError, RemoteDisconnectedError, XferHandle
from kvfsm.layout import Int64Array, coalesce
from kvfsm.runtime._conformance import Conformance
from kvfsm.runtime._guests import Guests
from kvfsm.runtime._handshake import Directory, HandshakeError, PeerInfo, StatusQuery
from kvfsm.runtime._integrity import kv_checksum
from kvfsm.runtime._kv import KvCache
from kvfsm.runtime._routes import Route, plan_route, prepare_route
from kvfsm.runtime._seals import Seals, new_epoch
from kvfsm.runtime._trace import RequestTrace, TransferStats, trace_of
from kvfsm.wire import BlockIds, SharedSecret, decode, encode

__all__ = ["CallerOutput", "Engine", "InFlight"]

CallerOutput = (
    ReleaseBlocks | ReportReceived | ReportFailed | Finished | RequestTrace | InternalError
)


class InFlight(msgspec.Struct):
    """A posted transfer, checked until it ends."""

    request_id: str
    handle: XferHandle
    peer: str
    op: str
    bytes: int


def _drain_bound(configured: float | None, fabric: Fabric) -> float:
    """How long D holds blocks a given-up transfer may still write: the configured bound, or the
    fabric's own; a configured one below the fabric's would hand back blocks bytes still hit."""
    bound = fabric.late_delivery_s
    if configured is None:
        if math.isinf(bound):
            raise ValueError(
                f"{fabric.agent_name}: nothing bounds when a given-up transfer's bytes land "
                "(UCX_TCP_USER_TIMEOUT=inf over UCX's TCP transport): set a finite "
                "UCX_TCP_USER_TIMEOUT or leave tcp out of UCX_TLS"
            )
        return bound
    if configured < bound:
        raise ValueError(
            f"{fabric.agent_name}: CoreConfig.transport_drain_s={configured} is below the "
            f"{bound} s in which the fabric may still deliver a given-up transfer's bytes "
            "(UCX_TCP_USER_TIMEOUT plus slack over TCP): D would hand back blocks they hit"
        )
    return configured


class Engine:
    """One engine rank: a core side, a fabric agent and the KV cache it registered."""

    def __init__(
        self,
        side: Side,
        fabric: Fabric,
        kv: KvCache,
        directory: Directory,
        clock: Callable[[], float],
        *,
        coalesce: bool = False,
        secret: SharedSecret | None = None,
        guests: Guests | None = None,
        conformance: bool = False,
        incarnation: int | None = None,
    ) -> None:
        """`coalesce`: post each transfer as descriptor rows merged where adjacent on both sides
        (dynamic lists) instead of one prepared row per block per region (docs/performance.md
        compares the two). `secret`: the deployment's shared secret; every notification sent
        is sealed with it, and only notifications sealed with it are taken (the handshakes'
        `directory` and listener need it too). `guests`: who completed a handshake with this
        engine's listener; with it, notifications are taken only from them and from peers this
        engine handshaked with (None: the listener runs elsewhere, nothing to check against).
        `conformance`: replay every step the core takes through `transitions` (`.conformance`);
        a divergence is counted and comes out as an `InternalError` (docs/runtime.md).
        `incarnation`: this process of the engine rank, later than any before it under the
        same agent name (default: from the wall clock); peers check it before moving KV."""
        self.side = side
        self.fabric = fabric
        side.transport_drain_s = _drain_bound(side.config.transport_drain_s, fabric)
        self.kv = kv
        self.directory = directory
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self.outputs: list[CallerOutput] = []
        self.inflight: dict[int, InFlight] = {}
        self._local_is_p = side.side == "P"
        self._posts = self._local_is_p == (side.mode == "push")  # P WRITEs in push, D READs in pull
        self._coalesce = coalesce
        self._memory: list[int] = []
        try:
            for buffer in kv.buffers:
                self._memory.append(fabric.register_memory(buffer))
        except BaseException:
            self._deregister()
            raise
        self._routes: dict[str, Route] = {}  # peer agent (loaded) -> how to move KV with it
        self._local_rows: dict[str, Int64Array] = {}  # peer -> our rows of its pairing (verify)
        self.checksum: Callable[[KvCache, Int64Array], int] = kv_checksum
        """How the checksum of local rows is computed (`verify`): replaceable only by negative
        controls, e.g. one that corrupts the bytes after taking it."""
        self.incarnation = new_epoch() if incarnation is None else incarnation
        side.incarnation = self.incarnation
        # A late notification is waited for as long as any request could still use it: twice
        # the longest deadline, plus what the transport may still deliver after it.
        gap_ttl_s = 2 * side.config.longest_wait_s + side.transport_drain_s
        self._seals = Seals(side.identity.agent, secret, self.counters, self.incarnation, gap_ttl_s)
        self._guests = guests
        self._stats: dict[str, TransferStats] = {}
        self._queue: deque[Event] = deque()
        self.conformance = Conformance(self._diverged) if conformance else None
        if self.conformance is not None:
            side.set_recorder(self.conformance.record)
        self._closed = False
        self._runners: dict[type, Callable[[Any], None]] = {
            PostTransfer: self._post,
            SendNotification: self._notify,
            CancelTransfer: lambda c: self._cancel(c.transfer_id),
            StartHandshake: lambda c: self.directory.start(c.peer, c.contact),
            RemoveAgent: lambda c: self._forget_peer(c.peer),
            AskPeer: self._ask,
            VerifyBlocks: self._verify,
            Finished: self._finished,
        }

    @property
    def agent(self) -> str:
        """This engine's agent name."""
        return self.fabric.agent_name

    def info(self) -> PeerInfo:
        """What a peer's handshake with this engine returns."""
        metadata = self.fabric.get_agent_metadata()
        return PeerInfo(self.agent, metadata, self.kv.layout, incarnation=self.incarnation)

    def transfer_status(self, query: StatusQuery) -> TransferStatus:
        """The answer to a peer's question about a transfer (the side channel's listener
        asks; call it on the thread that drives this engine)."""
        if query.agent != self.agent:
            return "unknown"
        return self.side.transfer_status(
            query.requester, query.requester_request_id, query.request_id
        )

    @property
    def busy(self) -> bool:
        """Requests are live, transfers in flight or blocks held while late bytes may land: the
        fabric needs polling."""
        return bool(self.inflight or self.side.requests or len(self.side.quarantine))

    @property
    def peers(self) -> int:
        """Peer agents loaded (their notifications may arrive at any time)."""
        return len(self._routes)

    def routes(self) -> tuple[str, ...]:
        """The peer agents loaded, sorted: those with a route planned for moving KV."""
        return tuple(sorted(self._routes))

    def next_wakeup(self) -> float | None:
        """When the core next needs a `Tick` (a deadline, heartbeat or expiry), if ever."""
        return self.side.next_wakeup()

    # --- driving -------------------------------------------------------------------------------

    def submit(self, event: Event) -> None:
        """Feed one event, and every event its commands cause, through the core."""
        queue = self._queue
        queue.append(event)
        while queue:
            for command in self.side.handle(queue.popleft(), self.clock()):
                try:
                    self._execute(command)
                except Exception as exc:  # a bug: the other commands still run
                    self._command_failed(command, exc)

    def poll(self) -> bool:
        """Take finished handshakes, drain notifications, check in-flight transfers and fire due
        deadlines; True if anything arrived or ended."""
        active = False
        for peer, result in self.directory.results():
            self._connect(peer, result)
            active = True
        for query, status in self.directory.answers():
            self._queue.append(PeerAnswered(query.agent, query.requester_request_id, status))
            active = True
        for sender, messages in self._notifications().items():
            for payload in messages:
                self._receive(sender, payload)
                active = True
        for tid, flight in list(self.inflight.items()):
            active |= self._check(tid, flight)
        self.submit(Tick())  # also runs the results queued by the checks
        return active

    def take_outputs(self) -> list[CallerOutput]:
        """The caller-facing commands since the last call."""
        out, self.outputs = self.outputs, []
        return out

    def close(self) -> None:
        """Release every handle, list, remote agent and the registrations."""
        if self._closed:
            return
        self._closed = True
        with _Tolerant(self.counters, "close"):
            for flight in self.inflight.values():
                self.fabric.release_xfer_handle(flight.handle)
            self.inflight.clear()
            for peer in list(self._routes):
                self._forget_peer(peer)
        self._deregister()
        # Held blocks go back now: the engine is done with the fabric (the caller closes the
        # agent next, and with it every connection late bytes could come by).
        for request_id, blocks in self.side.quarantine.due(math.inf):
            self.outputs.append(ReleaseBlocks(request_id, blocks))

    # --- executing commands ----------------------------------------------------------------------

    def _execute(self, command: Command) -> None:
        run = self._runners.get(type(command))
        if run is None:
            self.outputs.append(command)  # type: ignore[arg-type]  # a caller output
        else:
            run(command)

    def _diverged(self, message: str) -> None:
        self.counters["conformance_divergence"] += 1
        self.outputs.append(InternalError(message))

    def _command_failed(self, command: Command, exc: Exception) -> None:
        """Tell the caller, and the core, which abandons the request the command was for."""
        self.counters["internal_error"] += 1
        rid = getattr(command, "request_id", "")
        detail = f"executing {type(command).__name__}: {exc!r}"
        trace = short_trace(exc)
        self.outputs.append(InternalError(f"runtime: {detail}", (rid,) if rid else (), trace))
        if rid:
            self._queue.append(CommandFailed(rid, detail))

    def _finished(self, command: Finished) -> None:
        self.outputs.append(command)
        self.outputs.append(trace_of(command, self._stats.pop(command.request_id, None)))

    def _connect(self, peer: str, result: PeerInfo | HandshakeError) -> None:
        try:
            if isinstance(result, HandshakeError):
                raise result
            if result.agent != peer:
                raise HandshakeError(f"asked for {peer!r}, {result.agent!r} answered")
            self._forget_peer(peer)
            self._routes[peer] = self._route(peer, result)
        except (HandshakeError, FabricError, ValueError) as exc:
            self.counters["handshake_failed"] += 1
            self._queue.append(HandshakeFailed(peer, str(exc)))
            return
        self._queue.append(
            HandshakeDone(peer, result.clock_offset, result.clock_error, result.incarnation)
        )

    def _receive(self, sender: str, data: bytes) -> None:
        """One notification: opened (with a secret), then to the core if the sender is a peer
        we handshaked with or a guest of our listener; else counted and dropped."""
        opened = self._seals.open(sender, data, self.clock())
        if opened is None:
            return
        guests = self._guests
        if guests is None or sender in self._routes or guests.admitted(self.agent, sender):
            self.submit(NotificationReceived(sender, opened))
        else:
            self.counters["stranger"] += 1

    def _route(self, peer: str, info: PeerInfo) -> Route:
        route = plan_route(self.kv.geometry, info.layout.geometry, local_is_p=self._local_is_p)
        self.fabric.add_remote_agent(info.metadata)
        if not self._posts:
            return route
        try:
            return prepare_route(route, self.fabric, self.kv, peer, info.layout)
        except BaseException:
            with _Tolerant(self.counters, "remove_agent"):
                self.fabric.remove_remote_agent(peer)
            raise

    def _forget_peer(self, peer: str) -> None:
        self._local_rows.pop(peer, None)
        route = self._routes.pop(peer, None)
        if route is None:
            return
        self.counters["peers_removed"] += 1
        with _Tolerant(self.counters, "remove_agent"):
            for dlist in (route.local, route.remote):
                if dlist is not None:
                    self.fabric.release_dlist_handle(dlist)
            self.fabric.remove_remote_agent(peer)

    def _post(self, cmd: PostTransfer) -> None:
        stats = self._stats.setdefault(cmd.request_id, TransferStats())
        stats.transfers += 1
        route = self._routes.get(cmd.peer)
        if route is None:
            self._post_failed(cmd, stats, None, "no connection to the peer")
            return
        try:
            rows = (
                None if route.pairing is None else route.rows(cmd.local_blocks, cmd.remote_blocks)
            )
        except ValueError as exc:
            self.counters["post_refused"] += 1
            self._post_failed(cmd, stats, None, str(exc))
            return
        if rows is None or not len(rows[0]):
            # Another rank moves the bytes (replicated KV), or there are none: only the
            # completion notification travels.
            ok = self._send(cmd.peer, cmd.notification)
            stats.failed += not ok
            self._queue.append(TransferResult(cmd.request_id, cmd.transfer_id, ok, "notify"))
            return
        self._start(cmd, route, rows, stats)

    def _start(
        self,
        cmd: PostTransfer,
        route: Route,
        rows: tuple[Int64Array, Int64Array],
        stats: TransferStats,
    ) -> None:
        assert route.local is not None and route.remote is not None  # prepared on a posting side
        local_rows, remote_rows = rows
        handle = None
        descriptors = len(local_rows)
        payload = cmd.notification
        if cmd.checksum and route.descriptors is not None:
            payload = _with_checksum(
                payload, self.checksum(self.kv, route.descriptors[0][local_rows])
            )
        notification = self._seals.seal(cmd.peer, payload)
        try:
            if self._coalesce and route.descriptors is not None:
                merged = coalesce(
                    route.descriptors[0][local_rows], route.descriptors[1][remote_rows]
                )
                descriptors = merged.after
                handle = self.fabric.make_xfer(
                    cmd.op, merged.local, cmd.peer, merged.remote, notification
                )
            else:
                handle = self.fabric.make_prepped_xfer(
                    cmd.op, route.local, local_rows, route.remote, remote_rows, notification
                )
            state = self.fabric.transfer(handle)
        except FabricError as exc:
            if isinstance(exc, RemoteDisconnectedError):
                self._lost(cmd.peer)
            self._post_failed(cmd, stats, handle, str(exc))
            return
        self.counters["posted"] += 1
        self.counters["descriptors"] += descriptors
        stats.descriptors += descriptors
        flight = InFlight(
            cmd.request_id, handle, cmd.peer, cmd.op, len(local_rows) * route.row_bytes
        )
        self.inflight[cmd.transfer_id] = flight
        if state != "PROC":
            self._finish(cmd.transfer_id, flight, state == "DONE", state)

    def _post_failed(
        self, cmd: PostTransfer, stats: TransferStats, handle: XferHandle | None, why: str
    ) -> None:
        self.counters["post_failed"] += 1
        stats.failed += 1
        if handle is not None:
            with _Tolerant(self.counters, "release"):
                self.fabric.release_xfer_handle(handle)
        self._queue.append(TransferResult(cmd.request_id, cmd.transfer_id, False, why))

    def _check(self, tid: int, flight: InFlight) -> bool:
        try:
            state = self.fabric.check_xfer_state(flight.handle)
        except FabricError as exc:
            if isinstance(exc, RemoteDisconnectedError):
                self._lost(flight.peer)  # the cause first, then what it did to the transfer
            self._finish(tid, flight, False, str(exc))
            return True
        if state == "PROC":
            return False
        self._finish(tid, flight, state == "DONE", state)
        return True

    def _finish(self, tid: int, flight: InFlight, ok: bool, why: str) -> None:
        del self.inflight[tid]
        stats = self._stats.get(flight.request_id)
        if ok:
            self.counters["bytes"] += flight.bytes
            if stats is not None:
                stats.bytes += flight.bytes
                with _Tolerant(self.counters, "telemetry"):
                    stats.measured(self.fabric.xfer_telemetry(flight.handle))
        elif stats is not None:
            stats.failed += 1
        with _Tolerant(self.counters, "release"):
            self.fabric.release_xfer_handle(flight.handle)
        self._queue.append(TransferResult(flight.request_id, tid, ok, "" if ok else why))

    def _cancel(self, tid: int) -> None:
        flight = self.inflight.pop(tid, None)
        if flight is not None:
            self.counters["cancelled"] += 1
            with _Tolerant(self.counters, "release"):
                self.fabric.release_xfer_handle(flight.handle)

    def _ask(self, cmd: AskPeer) -> None:
        query = StatusQuery(cmd.peer, self.agent, cmd.request_id, cmd.peer_request_id)
        self.directory.ask(cmd.peer, query)

    def _notify(self, cmd: SendNotification) -> None:
        payload = cmd.payload
        if cmd.checksum_blocks is not None:
            rows = self._rows_of(cmd.peer, *cmd.checksum_blocks)
            if rows is not None:  # else another rank moves these bytes: nothing to check
                payload = _with_checksum(payload, self.checksum(self.kv, rows))
        self._send(cmd.peer, payload)

    def _verify(self, cmd: VerifyBlocks) -> None:
        try:
            rows = self._rows_of(cmd.peer, cmd.local_blocks, cmd.remote_blocks)
            ok = rows is not None and self.checksum(self.kv, rows) == cmd.expected
        except (KeyError, ValueError):  # no route to the peer any more, or blocks that cannot pair
            ok = False
        self._queue.append(BlocksVerified(cmd.request_id, cmd.peer, ok))

    def _rows_of(self, peer: str, local: BlockIds, remote: BlockIds) -> Int64Array | None:
        """Our descriptor rows of the bytes moved with `peer` for these blocks (None: another
        rank moves them)."""
        route = self._routes[peer]
        if route.pairing is None:
            return None
        table = self._local_rows.get(peer)
        if table is None:
            table = route.descriptors[0] if route.descriptors is not None else None
            if table is None:
                table = route.pairing.local_descriptors(self.kv.layout)
            self._local_rows[peer] = table
        return table[route.rows(local, remote)[0]]

    def _send(self, peer: str, payload: bytes) -> bool:
        try:
            self.fabric.send_notif(peer, self._seals.seal(peer, payload))
        except FabricError as exc:
            self.counters["notify_failed"] += 1
            if isinstance(exc, RemoteDisconnectedError):
                self._lost(peer)
            return False
        return True

    def _lost(self, peer: str) -> None:
        """Report a lost peer, unless its agent is no longer loaded (a stale transfer's error)."""
        if peer in self._routes:
            self._queue.append(PeerLost(peer))
        else:
            self.counters["stale_peer_lost"] += 1

    def _notifications(self) -> dict[str, list[bytes]]:
        try:
            return self.fabric.get_new_notifs()
        except FabricError:
            self.counters["notif_drain_failed"] += 1
            return {}

    def _deregister(self) -> None:
        while self._memory:
            with _Tolerant(self.counters, "deregister"):
                self.fabric.deregister_memory(self._memory.pop())


def _with_checksum(payload: bytes, checksum: int) -> bytes:
    """The message in `payload` (a `Completion` or `Grant`) carrying `checksum`."""
    return encode(msgspec.structs.replace(decode(payload), checksum=checksum))


class _Tolerant:
    """Count a fabric error during cleanup instead of letting it stop the cleanup.

    A class, not a `contextmanager` generator: it runs twice per finished transfer (telemetry,
    release), where a generator-based one costs several times more a use."""

    __slots__ = ("counters", "what")

    def __init__(self, counters: Counter[str], what: str) -> None:
        self.counters, self.what = counters, what

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> bool:
        if kind is not None and issubclass(kind, FabricError):
            self.counters[f"{self.what}_error"] += 1
            return True
        return False
