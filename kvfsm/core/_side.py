"""What the P and D sides share: requests, peers, the transfer tally, deadlines and message routing.

`Side.handle(event, now)` is the whole interface: an event in, the commands to execute out. Nothing
here does I/O or reads a clock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, NamedTuple

from kvfsm.core._config import CoreConfig, Identity, Mode
from kvfsm.core._containment import requests_hit, short_trace
from kvfsm.core._deadlines import Deadlines, earliest
from kvfsm.core._dispatch import Dispatcher, Recorder, RunQueue, StepFailed
from kvfsm.core._io import (
    Abort,
    Admit,
    CancelTransfer,
    Command,
    CommandFailed,
    Drain,
    Finished,
    HandshakeDone,
    HandshakeFailed,
    InternalError,
    NotificationReceived,
    PeerAnswered,
    PeerLost,
    PrefillFinished,
    ReleaseBlocks,
    RemoveAgent,
    SendNotification,
    Shutdown,
    StartHandshake,
    Tick,
    TransferResult,
)
from kvfsm.core._quarantine import Quarantine
from kvfsm.core._questions import PeerQuestions
from kvfsm.core._records import EngineRecord, Peer, Request, TransferTally, caller_blocks
from kvfsm.core._tombstones import Tombstones
from kvfsm.lifecycle import LocalProtocolError, ProtocolError, RemoteProtocolError, load
from kvfsm.wire import BlockIds, Goodbye, Message, WireError, decode, encode

__all__ = ["MAX_PEERS", "MODEL_PREFIXES", "Side", "SideSnapshot"]

_MAX_ERRORS_KEPT = 64
MODEL_PREFIXES = {
    "request": "_req_",
    "peer": "_peer_",
    "transfer": "_tally_",
    "engine": "_engine_",
}
"""The prefix of the methods that implement each kind of lifecycle's guards and commands."""
_MAX_OUTBOX = 256  # replies queued for one peer that is not connected yet
MAX_PEERS = 4096
"""Peers a side remembers; past it, inert ones (never connected, failed or evicted; unused) go."""
_INERT = frozenset(("unknown", "failed", "evicted"))
_CALLER_EVENTS = (
    Admit,
    PrefillFinished,
    Abort,
    Shutdown,
    Drain,
)  # their own errors are the caller's


class SideSnapshot(NamedTuple):
    """What a side holds besides its requests and peers, read-only: its armed deadlines
    (key, event, at), its tombstones (id, how it ended) and when it next sweeps idle peers; for
    P, registrations not yet matched (sender, D's id, expiry), registrations already matched
    (key, P's id) and the base ids of ended requests; for D, its next heartbeat. `kvfsm check`
    builds its state fingerprint from it: whatever steers what happens next is here."""

    deadlines: tuple[tuple[str, str, float], ...]
    tombstones: tuple[tuple[str, str], ...]
    next_peer_sweep: float | None
    pending: tuple[tuple[str, str, float], ...] = ()
    consumed: tuple[tuple[str, str], ...] = ()
    ended_bases: tuple[str, ...] = ()
    next_heartbeat: float | None = None
    engine: str = "serving"


class Side(PeerQuestions):
    """The shared machinery of `Producer` and `Consumer`."""

    side: ClassVar[str]
    _deadline_events: ClassVar[dict[str, str]]  # arm_<kind> command -> event it fires

    def __init__(self, identity: Identity, mode: Mode, config: CoreConfig | None = None) -> None:
        self.identity = identity
        self.mode: Mode = mode
        self.config = config or CoreConfig()
        role = "producer" if self.side == "P" else "consumer"
        self.requests: dict[str, Request] = {}
        self.peers: dict[str, Peer] = {}
        self.counters: Counter[str] = Counter()
        self.errors: deque[str] = deque(maxlen=_MAX_ERRORS_KEPT)
        self.deadlines = Deadlines()
        self.queries = Deadlines()
        """When to ask a peer about a transfer whose completion is overdue (one per request,
        beside its deadline: `completion_overdue`)."""
        self.quarantine = Quarantine()
        self.transport_drain_s = self.config.transport_drain_s or 0.0
        """How long given-up transfers may still land (the runtime sets it from its fabric)."""
        self.incarnation = 0
        """This process of the engine rank, in its registrations and grants (the runtime sets
        it; 0: unknown)."""
        self.tombstones = Tombstones(self.config.tombstones)
        self._out: list[Command] = []
        self._now = 0.0
        self._runq = RunQueue()
        self._pending_steps = self._runq.pending
        self._alive_fn: Callable[[Any], bool] = self._alive  # bound once, not per event
        self._next_transfer_id = 0
        self._transfers: dict[int, tuple[str, str]] = {}  # transfer id -> (request, peer agent)
        self._req = Dispatcher(load(f"{role}_{mode}"), self, MODEL_PREFIXES["request"], self.side)
        self._req.on_terminal = self._on_request_ended
        self._peer = Dispatcher(load("peer"), self, MODEL_PREFIXES["peer"], self.side)
        self._tally = Dispatcher(load("transfer"), self, MODEL_PREFIXES["transfer"], self.side)
        self._engine = Dispatcher(load("engine"), self, MODEL_PREFIXES["engine"], self.side)
        self.engine = EngineRecord(identity.agent)
        """The local engine's lifecycle (`engine.state`: serving, draining, drained, closed)."""
        self._handlers: dict[type, Callable[[Any], None]] = {
            Abort: self._on_abort,
            Tick: self._on_tick,
            Shutdown: self._on_shutdown,
            Drain: self._on_drain,
            NotificationReceived: self._on_notification,
            HandshakeDone: self._on_handshake_done,
            HandshakeFailed: self._on_handshake_failed,
            PeerLost: lambda e: self._peer_event(e.peer, "peer_lost"),
            TransferResult: self._on_transfer_result,
            PeerAnswered: self._on_peer_answered,
            CommandFailed: self._on_command_failed,
        }
        self._messages: dict[type, Callable[[Any, str], None]] = {Goodbye: self._on_goodbye}
        self.shut_down = False
        self._next_peer_sweep: float | None = None  # while a peer is connected

    # --- the interface ------------------------------------------------------------------------

    def snapshot(self) -> SideSnapshot:
        """This side's bookkeeping beyond requests and peers (see `SideSnapshot`)."""
        return SideSnapshot(
            deadlines=(*self.deadlines.armed(), *self.queries.armed()),
            tombstones=tuple(self.tombstones.items()),
            next_peer_sweep=self._next_peer_sweep,
            engine=self.engine.state,
        )

    def handle(self, event: Any, now: float) -> list[Command]:
        """Process one event at time `now`; return the commands to execute, in order.

        A bug (a guard or command that raises, or any error while a network or runtime event
        is handled) loses none of the commands already emitted: the requests it hit are
        abandoned safely (`internal_error`), an `InternalError` says what happened, and the
        other requests go on. The caller's own mistakes (an id admitted twice) still raise."""
        self._now = now
        out: list[Command] = []
        self._out = out
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"{self.side} does not take {type(event).__name__} events")
        try:
            handler(event)
        except StepFailed as failed:
            self._contain(failed, failed.cause, failed.instances)
        except Exception as exc:
            if isinstance(event, _CALLER_EVENTS):
                raise
            self._contain(exc, exc, ())
        while self._pending_steps:
            try:
                self._runq.drain(now, self._alive_fn)
            except StepFailed as failed:
                self._contain(failed, failed.cause, failed.instances)
            except Exception as exc:  # a queued event its instance does not take: a bug
                self._contain(exc, exc, ())
        if self.engine.state == "draining" and self._settled():
            self._engine.fire(self.engine, "settled", now)
        return out

    def set_recorder(self, recorder: Recorder | None) -> None:
        """Report every step taken (for conformance checks and coverage); None to stop."""
        for dispatcher in (self._req, self._peer, self._tally, self._engine):
            dispatcher.recorder = recorder

    @property
    def draining(self) -> bool:
        """The engine drains or is drained: it takes no new request or registration."""
        return self.engine.state in ("draining", "drained")

    def next_wakeup(self) -> float | None:
        """When the side next needs a `Tick` (its next deadline), for an event loop's timeout."""
        return earliest(
            self.deadlines.next_at(),
            self.queries.next_at(),
            self._next_peer_sweep,
            self.quarantine.next_at(),
        )

    # --- common event handlers ------------------------------------------------------------------

    def _on_abort(self, event: Abort) -> None:
        req = self.requests.get(event.request_id)
        if req is None:
            self.counters["abort_of_unknown"] += 1
            return
        req.abort_requested = True
        self._req.fire(req, "abort", self._now)

    def _on_tick(self, _event: Tick) -> None:
        for key, event in (*self.deadlines.due(self._now), *self.queries.due(self._now)):
            req = self.requests.get(key)
            if req is not None:
                self._req.fire(req, event, self._now)
                self._runq.drain(self._now, self._alive_fn)
        if self._next_peer_sweep is not None and self._now >= self._next_peer_sweep:
            self._sweep_peers()
        for request_id, blocks in self.quarantine.due(self._now):
            self._emit(ReleaseBlocks(request_id, blocks))

    def _sweep_peers(self) -> None:
        """Evict the connected peers no live request used for the idle TTL (the number of peers
        is the number of remote ranks: a scan of them and the live requests is cheap every half
        TTL)."""
        used = {agent for req in self.requests.values() for agent in req.peers}
        ttl = self.config.peer_idle_ttl_s
        for peer in list(self.peers.values()):
            if peer.state != "connected":
                continue
            if peer.id in used:
                peer.idle_since = self._now
            elif self._now - peer.idle_since >= ttl:
                self._peer.fire(peer, "idle_expired", self._now)
        connected = any(p.state == "connected" for p in self.peers.values())
        self._next_peer_sweep = self._now + ttl / 2 if connected else None

    def _on_shutdown(self, _event: Shutdown) -> None:
        self.shut_down = True
        for req in list(self.requests.values()):
            if req.state in self._req.lifecycle.terminal:
                continue
            req.abort_requested = True
            if self._req.accepts(req.state, "abort"):
                self._req.fire(req, "abort", self._now)
        if self.engine.state != "closed":  # goodbyes go out before the agents are unloaded
            self._engine.fire(self.engine, "shutdown", self._now)
        for peer in list(self.peers.values()):
            self._peer.fire(peer, "shutdown", self._now)

    def _on_drain(self, _event: Drain) -> None:
        self._engine.fire(self.engine, "drain", self._now)

    def _on_handshake_done(self, event: HandshakeDone) -> None:
        peer = self.peers.get(event.peer)
        if peer is not None:
            peer.measured(event.clock_offset, event.clock_error)
            peer.incarnation = event.incarnation
            peer.idle_since = self._now
            if self._next_peer_sweep is None:
                self._next_peer_sweep = self._now + self.config.peer_idle_ttl_s / 2
        self._peer_event(event.peer, "handshake_done")

    def _local_time(self, agent: str, peer_time: float) -> float:
        """A time on `agent`'s clock as the earliest it can be on ours (deadlines cross hosts:
        taking them early is the safe side for every deadline kvfsm sends)."""
        peer = self.peers.get(agent)
        if peer is None:
            return peer_time
        return peer_time - peer.clock_offset - peer.clock_error

    def _on_handshake_failed(self, event: HandshakeFailed) -> None:
        self._count_error("handshake_failed", f"{event.peer}: {event.reason}")
        self._peer_event(event.peer, "handshake_failed")

    def _on_transfer_result(self, event: TransferResult) -> None:
        owner = self._transfers.pop(event.transfer_id, None)
        req = self.requests.get(owner[0]) if owner else None
        if owner is None or req is None:
            self._count_error("late", f"transfer {event.transfer_id} result after its request")
            return
        if not event.ok:
            self._count_error("transfer_failed", f"{req.id}: {event.reason}")
        self._transfer_ended(req, owner[1], event.ok)

    def _transfer_ended(self, req: Request, peer: str, ok: bool) -> None:
        """A transfer this side posted ended (D overrides: a READ's bytes are checked first)."""
        self._tally_result(req, peer, ok)

    def _on_notification(self, event: NotificationReceived) -> None:
        try:
            message = decode(event.payload)
        except WireError as exc:
            self._count_error("malformed", f"from {event.sender}: {exc}")
            return
        route = self._messages.get(type(message))
        if route is None:
            self._count_error("unexpected", f"{type(message).__name__} from {event.sender}")
            return
        route(message, event.sender)

    # --- containing bugs ------------------------------------------------------------------------

    def _contain(self, exc: Exception, cause: BaseException, instances: Iterable[Any]) -> None:
        hit = requests_hit(self.requests, instances)
        self._count_error("internal_error", str(exc))
        self._emit(InternalError(f"{self.side}: {exc}", tuple(hit), short_trace(cause)))
        for req in hit.values():
            self._abandon(req)

    def _on_command_failed(self, event: CommandFailed) -> None:
        req = self.requests.get(event.request_id)
        if req is None:
            self._count_error("late", f"command failed for ended {event.request_id!r}")
            return
        self._count_error("internal_error", f"{req.id}: {event.detail}")  # the runtime told
        self._abandon(req)  # the caller (`InternalError`)

    def _abandon(self, req: Request) -> None:
        """Fire `internal_error`; should that raise too, the request's deadlines still end it."""
        try:
            self._req.fire(req, "internal_error", self._now)
        except Exception as exc:
            self._count_error("internal_error", f"abandoning {req.id!r}: {exc!r}")

    def _req_cmd_abandon(self, req: Request) -> None:
        # Cancel what is posted, tell the peers, and hold the blocks until nothing a peer was
        # ever allowed to post can touch them (a bug path: waiting long is the safe side).
        self._req_cmd_cancel_transfers(req)
        self._tell_peers_abandoned(req)
        if not req.released:
            req.released = True
            self.quarantine.hold(self._now + self._abandon_hold_s(), req.id, req.blocks)

    def _tell_peers_abandoned(self, req: Request) -> None:
        raise NotImplementedError

    def _abandon_hold_s(self) -> float:
        raise NotImplementedError

    # --- helpers for the sides ------------------------------------------------------------------

    def _emit(self, command: Command) -> None:
        self._out.append(command)

    def _send(self, peer: str, message: Message) -> None:
        self._out.append(SendNotification(peer, encode(message)))

    def _peer_of(self, agent: str, contact: str = "") -> Peer:
        """The peer `agent`, created on first use; a non-empty `contact` replaces what was known
        (a restarted peer may listen elsewhere)."""
        peer = self.peers.get(agent)
        if peer is None:
            if len(self.peers) >= MAX_PEERS:
                self._forget_inert_peers()
            peer = self.peers[agent] = Peer(agent, contact=contact)
        elif contact:
            peer.contact = contact
        return peer

    def _forget_inert_peers(self) -> None:
        """Drop peers nothing needs: only a contact learned, failed or evicted (no agent
        loaded), with nobody waiting and no request naming them (a new request meets such a
        peer afresh, as `unknown`).
        Bounds memory under messages from ever new agent names."""
        named = {agent for req in self.requests.values() for agent in req.peers}
        for agent, peer in list(self.peers.items()):
            inert = peer.state in _INERT and not peer.waiters and not peer.outbox
            if inert and agent not in named:
                del self.peers[agent]
                self.counters["peers_forgotten"] += 1

    def _reply(self, agent: str, message: Message, contact: str = "") -> None:
        """Send `message` to `agent`, connecting first (at `contact`, if given) if needed, with
        a bounded queue meanwhile."""
        peer = self.peers.get(agent)
        if peer is not None and peer.state == "connected":
            self._send(agent, message)
            return
        peer = self._peer_of(agent, contact)
        if peer.state == "closed" or len(peer.outbox) >= _MAX_OUTBOX:
            self.counters["unanswerable"] += 1
            return
        peer.outbox.append(encode(message))
        self._peer.fire(peer, "connect", self._now)

    def _count_error(self, kind: str, detail: str) -> None:
        self.counters[kind] += 1
        self.errors.append(f"{kind}: {detail}")

    def _fire_from_peer(self, req: Request, event: str) -> None:
        """Fire a peer-caused event; a peer's protocol error is counted and dropped, never raised."""
        try:
            self._req.fire(req, event, self._now)
        except RemoteProtocolError as exc:
            self._count_error("protocol_error", str(exc))

    def _new_request(self, request_id: str, blocks: BlockIds) -> Request:
        if self.shut_down:
            raise RuntimeError(f"{self.side} is shut down: cannot admit {request_id!r}")
        if self.draining:  # the caller's fault: it asked for the drain
            raise LocalProtocolError(request_id, self.side, "engine", self.engine.state, "admit")
        if request_id in self.requests:  # the caller admitted it twice
            state, name = self.requests[request_id].state, self._req.lifecycle.name
            raise LocalProtocolError(request_id, self.side, name, state, "admit")
        initial = self._req.lifecycle.initial
        history = ("admit", initial, self._now) if self.config.trace else None
        blocks = caller_blocks(request_id, blocks)
        req = Request(request_id, initial, blocks, TransferTally(request_id, 1), history)
        self.requests[request_id] = req
        return req

    def _new_transfer_id(self) -> int:
        self._next_transfer_id += 1
        return self._next_transfer_id

    def _alive(self, inst: Any) -> bool:
        if isinstance(inst, (Request, TransferTally)):
            req = self.requests.get(inst.id)
            return req is not None and (req is inst or req.tally is inst)
        return True

    def _on_request_ended(self, req: Request) -> None:
        del self.requests[req.id]
        self.deadlines.disarm(req.id)
        self.queries.disarm(req.id)
        self.tombstones.add(req.id, req.state)
        self._stop_waiting(req)
        self._forget(req)
        self._emit(Finished(req.id, req.state, req.transitions()))

    def _stop_waiting(self, req: Request) -> None:
        """The request no longer waits for its peers' connections (it ended, or forgot them)."""
        for agent in req.peers:
            peer = self.peers.get(agent)
            if peer is not None:
                peer.waiters.pop(req.id, None)

    def _forget(self, req: Request) -> None:
        """Drop the side's indexes of a request that ended."""
        for link in req.links.values():
            self._transfers.pop(link.transfer_id, None)

    def _arm(self, req: Request, command: str, seconds: float) -> None:
        self.deadlines.arm(req.id, self._now + seconds, self._deadline_events[command])

    def _tally_result(self, req: Request, key: str, ok: bool) -> None:
        """Count one transfer result; a second result for the same key is a duplicate."""
        tally = req.tally
        if key in tally.reported:
            self._count_error("duplicate", f"result for {req.id!r} from {key}")
            return
        tally.reported += (key,)
        link = req.links.get(key)
        if link is not None:
            link.ok = ok
        if ok:
            tally.ok += 1
        else:
            tally.failed += 1
        if tally.state in self._tally.lifecycle.terminal:
            self._count_error("late", f"result for {req.id!r} after its tally closed")
            return
        self._tally.fire(tally, "result_ok" if ok else "result_failed", self._now)

    def _stale(self, agent: str, incarnation: int) -> bool:
        """Whether our connection to `agent` reaches another process than the `incarnation`
        whose block ids we hold (it restarted under its name): they would be another's memory."""
        peer = self.peers.get(agent)
        reached = 0 if peer is None else peer.incarnation
        if not (incarnation and reached) or incarnation == reached:
            return False
        self._count_error("stale_incarnation", f"{agent}: ids of {incarnation}, on {reached}")
        return True

    def _connected(self, agents: Iterable[str]) -> bool:
        peers = self.peers
        for agent in agents:
            peer = peers.get(agent)
            if peer is None or peer.state != "connected":
                return False
        return True

    # --- request guards and commands shared by both sides -------------------------------------

    def _req_guard_has_blocks(self, req: Request) -> bool:
        return len(req.blocks) > 0

    def _req_guard_abort_requested(self, req: Request) -> bool:
        return req.abort_requested

    def _req_guard_peer_connected(self, req: Request) -> bool:
        return self._connected(req.peers)  # vacuously true for a request without peers

    def _req_cmd_connect_peer(self, req: Request) -> None:
        for agent in req.peers:
            peer = self._peer_of(agent)
            if peer.state != "connected":
                peer.waiters[req.id] = None
                self._peer.fire(peer, "connect", self._now)

    def _req_cmd_cancel_transfers(self, req: Request) -> None:
        for link in req.links.values():
            if link.transfer_id and link.agent not in req.tally.reported:
                self._transfers.pop(link.transfer_id, None)
                self._emit(CancelTransfer(req.id, link.transfer_id))

    def _req_cmd_release_blocks(self, req: Request) -> None:
        req.released = True
        if self.transport_drain_s > 0 and self._may_still_land(req):
            self.quarantine.hold(self._now + self.transport_drain_s, req.id, req.blocks)
        else:
            self._emit(ReleaseBlocks(req.id, req.blocks))

    def _may_still_land(self, req: Request) -> bool:
        """Whether a transfer given up on may still write the request's blocks (D overrides)."""
        return False

    # --- the peer lifecycle ---------------------------------------------------------------------

    def _peer_event(self, agent: str, event: str) -> None:
        peer = self.peers.get(agent)
        if peer is None:
            self._count_error("unknown_peer", f"{event} for {agent}")
            return
        try:
            self._peer.fire(peer, event, self._now)
        except ProtocolError as exc:
            self._count_error("protocol_error", str(exc))

    def _peer_cmd_start_handshake(self, peer: Peer) -> None:
        self._emit(StartHandshake(peer.id, peer.contact))

    def _peer_cmd_remove_agent(self, peer: Peer) -> None:
        self._emit(RemoveAgent(peer.id))

    def _peer_cmd_wake_waiters(self, peer: Peer) -> None:
        outbox, peer.outbox = peer.outbox, []
        self._out.extend(SendNotification(peer.id, payload) for payload in outbox)
        waiters, peer.waiters = peer.waiters, {}
        for rid in waiters:
            req = self.requests.get(rid)
            if req is not None:
                self._runq.post(self._req, req, "peer_connected")

    def _peer_cmd_fail_waiters(self, peer: Peer) -> None:
        self.counters["unanswerable"] += len(peer.outbox)
        peer.waiters, peer.outbox = {}, []
        for req in list(self.requests.values()):
            if peer.id in req.peers:
                req.lost |= {peer.id}
                self._runq.post(self._req, req, "peer_unreachable")

    def _on_goodbye(self, msg: Goodbye, sender: str) -> None:
        peer = self.peers.get(sender)
        if peer is None:
            self.counters["goodbye_unknown"] += 1
            return
        if msg.incarnation and peer.incarnation and msg.incarnation != peer.incarnation:
            self._count_error("stale_incarnation", f"goodbye from {sender}'s {msg.incarnation}")
            return
        self.counters["goodbyes"] += 1
        self._peer_event(sender, "goodbye")

    # --- the engine lifecycle -------------------------------------------------------------------

    def _settled(self) -> bool:
        """Nothing live and nothing held: the drain is over."""
        return not self.requests and not len(self.quarantine)

    def _engine_cmd_stop_intake(self, _engine: EngineRecord) -> None:
        """New work is refused where it arrives (admission, registrations); P overrides."""

    def _engine_cmd_say_goodbye(self, _engine: EngineRecord) -> None:
        # Not to a peer a live request still uses (a shutdown with transfers in flight): it
        # would take the goodbye as the loss of this engine and end its side of the request
        # while our transfer may still land; it learns of the loss from the fabric instead.
        bye = Goodbye(self.identity.rank, self.identity.tp_size, self.incarnation)
        used = {agent for req in self.requests.values() for agent in req.peers}
        for peer in self.peers.values():
            if peer.state == "connected" and peer.id not in used:
                self._send(peer.id, bye)
                self.counters["goodbyes_sent"] += 1

    # --- the transfer tally ---------------------------------------------------------------------

    def _tally_guard_outstanding(self, tally: TransferTally) -> bool:
        return tally.ok + tally.failed < tally.expected

    def _tally_cmd_signal_complete(self, tally: TransferTally) -> None:
        self._runq.post(self._req, self.requests[tally.id], "transfer_complete")

    def _tally_cmd_signal_failed(self, tally: TransferTally) -> None:
        self._runq.post(self._req, self.requests[tally.id], "transfer_failed")
