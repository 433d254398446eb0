"""The engine: feeds one side of the core with events and executes its commands on a fabric.

It owns the fabric through its data plane (`_dataplane`: every fabric call inside `submit`/`poll`
on the caller's thread, or on a data-plane thread of its own), turns notifications, transfer
states and handshake results into events, and hands the caller the commands that concern it
(blocks released, requests received or failed, requests finished) and a `RequestTrace` of each
finished request.
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
from kvfsm.fabric import Fabric, FabricError, XferHandle
from kvfsm.layout import Int64Array, coalesce
from kvfsm.runtime._conformance import Conformance
from kvfsm.runtime._dataplane import (
    DataPlane,
    DataPlaneKind,
    InlinePlane,
    MakeTransfer,
    NotificationsDrained,
    NotifySent,
    PlaneResult,
    ThreadedPlane,
    TransferEnded,
)
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
    """A transfer handed to the data plane, until it ends."""

    request_id: str
    handle: XferHandle | None
    """The fabric's handle where the engine's thread knows it (not with a data-plane thread)."""
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
        data_plane: DataPlaneKind = "loop",
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
        same agent name (default: from the wall clock); peers check it before moving KV.
        `data_plane`: where the fabric calls run, "loop" (the thread driving the engine) or
        "thread" (a data-plane thread, started by the `EngineLoop` that drives the engine)."""
        self.side = side
        self.plane: DataPlane
        if data_plane == "loop":
            self.plane = InlinePlane(fabric, self._on_plane)
        elif data_plane == "thread":
            name = f"kvfsm-plane-{fabric.agent_name}"
            self.plane = ThreadedPlane(fabric, self._on_plane, name=name)
        else:
            raise ValueError(f"data_plane must be 'loop' or 'thread', not {data_plane!r}")
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
    def fabric(self) -> Fabric:
        """The fabric agent (call it only where the data plane runs its calls)."""
        return self.plane.fabric

    @fabric.setter
    def fabric(self, fabric: Fabric) -> None:
        self.plane.fabric = fabric

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
        active |= self.plane.progress()
        self.submit(Tick())  # also runs the results queued by the checks
        self.plane.busy = self.busy
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
            self.plane.close()  # a data-plane thread stops: the fabric is this thread's now
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
        return self.plane.run(lambda fabric: self._prepare(fabric, route, peer, info))

    def _prepare(self, fabric: Fabric, route: Route, peer: str, info: PeerInfo) -> Route:
        """Load the peer's agent and, on the posting side, prepare the route's lists."""
        fabric.add_remote_agent(info.metadata)
        if not self._posts:
            return route
        try:
            return prepare_route(route, fabric, self.kv, peer, info.layout)
        except BaseException:
            with _Tolerant(self.counters, "remove_agent"):
                fabric.remove_remote_agent(peer)
            raise

    def _forget_peer(self, peer: str) -> None:
        self._local_rows.pop(peer, None)
        route = self._routes.pop(peer, None)
        if route is None:
            return
        self.counters["peers_removed"] += 1
        with _Tolerant(self.counters, "remove_agent"):
            self.plane.run(lambda fabric: _unload(fabric, route, peer))

    def _post(self, cmd: PostTransfer) -> None:
        stats = self._stats.setdefault(cmd.request_id, TransferStats())
        stats.transfers += 1
        route = self._routes.get(cmd.peer)
        if route is None:
            self._post_failed(cmd, stats, "no connection to the peer")
            return
        try:
            rows = (
                None if route.pairing is None else route.rows(cmd.local_blocks, cmd.remote_blocks)
            )
        except ValueError as exc:
            self.counters["post_refused"] += 1
            self._post_failed(cmd, stats, str(exc))
            return
        if rows is None or not len(rows[0]):
            # Another rank moves the bytes (replicated KV), or there are none: only the
            # completion notification travels, and is the transfer's result.
            self._send(cmd.peer, cmd.notification, cmd.request_id, cmd.transfer_id)
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
        descriptors = len(local_rows)
        payload = cmd.notification
        if cmd.checksum and route.descriptors is not None:
            payload = _with_checksum(
                payload, self.checksum(self.kv, route.descriptors[0][local_rows])
            )
        notification = self._seals.seal(cmd.peer, payload)
        op, peer, local, remote = cmd.op, cmd.peer, route.local, route.remote
        make: MakeTransfer
        if self._coalesce and route.descriptors is not None:
            merged = coalesce(route.descriptors[0][local_rows], route.descriptors[1][remote_rows])
            descriptors = merged.after

            def make(fabric: Fabric) -> XferHandle:
                return fabric.make_xfer(op, merged.local, peer, merged.remote, notification)
        else:

            def make(fabric: Fabric) -> XferHandle:
                return fabric.make_prepped_xfer(
                    op, local, local_rows, remote, remote_rows, notification
                )

        # Counted when handed to the fabric; `post_failed` counts those it refused.
        self.counters["posted"] += 1
        self.counters["descriptors"] += descriptors
        stats.descriptors += descriptors
        flight = InFlight(cmd.request_id, None, peer, op, len(local_rows) * route.row_bytes)
        self.inflight[cmd.transfer_id] = flight
        flight.handle = self.plane.post(cmd.transfer_id, make)

    def _post_failed(self, cmd: PostTransfer, stats: TransferStats, why: str) -> None:
        self.counters["post_failed"] += 1
        stats.failed += 1
        self._queue.append(TransferResult(cmd.request_id, cmd.transfer_id, False, why))

    def _on_plane(self, result: PlaneResult) -> None:
        """A result from the data plane, on the engine's thread."""
        if isinstance(result, NotificationsDrained):
            self.counters["notif_drain_failed"] += result.failed
            for sender, messages in result.by_sender.items():
                for payload in messages:
                    self._receive(sender, payload)
        elif isinstance(result, TransferEnded):
            self._ended(result)
        elif isinstance(result, NotifySent):
            self._sent(result)
        else:
            self.counters["internal_error"] += 1
            self.outputs.append(InternalError(result.detail, (), result.trace))

    def _ended(self, ended: TransferEnded) -> None:
        flight = self.inflight.pop(ended.transfer_id, None)
        if flight is None:  # cancelled after it ended, before its result was taken
            return
        for fault in ended.faults:
            self.counters[f"{fault}_error"] += 1
        if ended.lost:
            self._lost(flight.peer)  # the cause first, then what it did to the transfer
        stats = self._stats.get(flight.request_id)
        if not ended.posted:
            self.counters["post_failed"] += 1
        if ended.ok:
            self.counters["bytes"] += flight.bytes
            if stats is not None:
                stats.bytes += flight.bytes
                stats.measured(ended.telemetry)
        elif stats is not None:
            stats.failed += 1
        result = TransferResult(flight.request_id, ended.transfer_id, ended.ok, ended.why)
        self._queue.append(result)

    def _sent(self, sent: NotifySent) -> None:
        if not sent.ok:
            self.counters["notify_failed"] += 1
            if sent.lost:
                self._lost(sent.peer)
        if sent.transfer_id is not None:
            stats = self._stats.get(sent.request_id)
            if stats is not None:
                stats.failed += not sent.ok
            result = TransferResult(sent.request_id, sent.transfer_id, sent.ok, "notify")
            self._queue.append(result)

    def _cancel(self, tid: int) -> None:
        flight = self.inflight.pop(tid, None)
        if flight is not None:
            self.counters["cancelled"] += 1
            self.plane.cancel(tid)

    def _ask(self, cmd: AskPeer) -> None:
        query = StatusQuery(cmd.peer, self.agent, cmd.request_id, cmd.peer_request_id)
        self.directory.ask(cmd.peer, query)

    def _notify(self, cmd: SendNotification) -> None:
        payload = cmd.payload
        if cmd.checksum_blocks is not None:
            rows = self._rows_of(cmd.peer, *cmd.checksum_blocks)
            if rows is not None:  # else another rank moves these bytes: nothing to check
                payload = _with_checksum(payload, self.checksum(self.kv, rows))
        self._send(cmd.peer, payload, "", None)

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

    def _send(self, peer: str, payload: bytes, request_id: str, tid: int | None) -> None:
        self.plane.send(peer, self._seals.seal(peer, payload), request_id, tid)

    def _lost(self, peer: str) -> None:
        """Report a lost peer, unless its agent is no longer loaded (a stale transfer's error)."""
        if peer in self._routes:
            self._queue.append(PeerLost(peer))
        else:
            self.counters["stale_peer_lost"] += 1

    def _deregister(self) -> None:
        while self._memory:
            with _Tolerant(self.counters, "deregister"):
                self.fabric.deregister_memory(self._memory.pop())


def _unload(fabric: Fabric, route: Route, peer: str) -> None:
    """Release a route's prepared lists and forget the peer's agent."""
    for dlist in (route.local, route.remote):
        if dlist is not None:
            fabric.release_dlist_handle(dlist)
    fabric.remove_remote_agent(peer)


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
