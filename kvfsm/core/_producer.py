"""The prefill side (P): hold finished blocks under a lease, match D's registrations, WRITE (push) or
grant D's READ (pull), release each block exactly once."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from kvfsm.core._config import CoreConfig, Identity, Mode, paired_ranks
from kvfsm.core._deadlines import earliest
from kvfsm.core._io import (
    Admit,
    PostTransfer,
    PrefillFinished,
    SendNotification,
    Tick,
    TransferStatus,
)
from kvfsm.core._matching import PendingRegistrations
from kvfsm.core._records import (
    EngineRecord,
    Request,
    TransferTally,
    caller_blocks,
    link_status,
)
from kvfsm.core._side import Side, SideSnapshot
from kvfsm.core._tombstones import Tombstones
from kvfsm.wire import (
    BlockIds,
    Cancel,
    CancelAck,
    Completion,
    Failure,
    Grant,
    Heartbeat,
    Progress,
    Registration,
    base_request_id,
    encode,
    pack_blocks,
    unpack_blocks,
)

__all__ = ["ConsumerLink", "Producer"]


class ConsumerLink(msgspec.Struct, gc=False):
    """One D rank's part in a P request: where to write (push) or whom to grant (pull)."""

    agent: str
    request_id: str  # D's id for the request
    block_ids: BlockIds
    deadline: float = 0.0  # push: no WRITE may be posted at or after this time
    transfer_id: int = 0  # push: the WRITE posted to this rank
    granted: bool = False  # pull: the grant was sent
    given_up: bool = False  # lost before anything was posted or granted to it: its share failed
    incarnation: int = 0  # the D process that registered (0: unknown)
    ok: bool | None = None  # its transfer's result, once counted


class Producer(Side):
    """P's side of every request, both modes. Feed events with `handle(event, now)`."""

    side: ClassVar[str] = "P"
    _deadline_events: ClassVar[dict[str, str]] = {
        "arm_lease": "lease_expired",
        "arm_stall": "stall_timeout",
    }

    def __init__(self, identity: Identity, mode: Mode, config: CoreConfig | None = None) -> None:
        super().__init__(identity, mode, config)
        self._waiting: dict[str, Request] = {}  # requests that may still take registrations
        # By base id: the one waiting request with it (the usual case: no dict per request), or
        # several in admission order.
        self._waiting_base: dict[str, Request | dict[str, Request]] = {}
        self._pending = PendingRegistrations(
            self.config.max_pending_registrations, self.config.pending_registration_ttl_s
        )
        self._consumed = Tombstones(self.config.tombstones)  # registrations already matched
        self._ended_bases = Tombstones(self.config.tombstones)  # base ids of ended requests
        self._by_consumer: dict[tuple[str, str], Request] = {}  # (D agent, D id) -> request
        self._sender = ""  # the agent whose cancel is being handled
        self._cancel: Cancel | None = None
        self._handlers.update({Admit: self._on_admit, PrefillFinished: self._on_prefill_finished})
        self._handlers[Tick] = self._on_p_tick
        self._messages.update(
            {
                Registration: self._on_registration,
                Cancel: self._on_cancel,
                Completion: self._on_completion,
                Heartbeat: self._on_heartbeat,
            }
        )

    # --- caller events --------------------------------------------------------------------------

    def _on_admit(self, event: Admit) -> None:
        req = self._new_request(event.request_id, event.blocks)
        req.base_id = base_request_id(req.id)
        self._wait(req)
        for pending in self._pending.take_for(req.id):
            if req.id in self._waiting:
                self._attach(req, pending.message, pending.sender)

    def _on_prefill_finished(self, event: PrefillFinished) -> None:
        req = self.requests.get(event.request_id)
        if req is None:
            kind = "late" if event.request_id in self.tombstones else "unknown"
            self._count_error(kind, f"prefill_finished for {event.request_id!r}")
            return
        req.blocks = caller_blocks(req.id, event.blocks)
        self._req.fire(req, "prefill_finished", self._now)
        if self.draining and req.state in _LEASED:
            self._req.fire(req, "intake_stopped", self._now)

    def snapshot(self) -> SideSnapshot:
        """The side's bookkeeping, with P's registrations: unmatched, matched, and ended bases."""
        return (
            super()
            .snapshot()
            ._replace(
                pending=tuple(self._pending.items()),
                consumed=tuple(self._consumed.items()),
                ended_bases=tuple(key for key, _ in self._ended_bases.items()),
            )
        )

    def next_wakeup(self) -> float | None:
        """When the next deadline, peer sweep or unmatched-registration expiry falls."""
        return earliest(super().next_wakeup(), self._pending.next_expiry())

    def _on_p_tick(self, event: Tick) -> None:
        for key in self._pending.expire(self._now):
            self._count_error("registration_expired", f"unmatched registration {key}")
        self._on_tick(event)

    # --- messages from D ------------------------------------------------------------------------

    def _on_registration(self, msg: Registration, sender: str) -> None:
        key = (sender, msg.sender_request_id)
        if msg.request_id in self.tombstones or msg.sender_request_id in self.tombstones:
            self._count_error("late", f"registration for ended request {msg.request_id!r}")
            self._reply(
                sender,
                Failure(msg.sender_request_id, msg.request_id, *self._me, "ended"),
                msg.contact,
            )
            return
        prior = self._consumed.get(_consumer_key(*key))
        if prior == _CANCELLED:  # overtaken by its own cancel: D gave up, P acknowledged
            self._count_error("late", f"registration {key} after its cancel")
            return
        if key in self._pending or prior is not None:
            self._count_error("duplicate", f"registration {key}")
            return
        req = self._match(msg)
        if self.draining and (req is None or not req.links):  # not another rank's share
            self._refuse_draining(msg, sender)
        elif req is not None:
            self._attach(req, msg, sender)
        elif not msg.request_id and base_request_id(msg.sender_request_id) in self._ended_bases:
            # D named no P id and the request its base id names has ended here: do not keep D
            # waiting for its watchdog.
            self._count_error("late", f"registration {key} for an ended request")
            self._reply(sender, Failure(msg.sender_request_id, "", *self._me, "ended"), msg.contact)
        elif self._pending.full:
            self._count_error("rejected", f"registration {key}: too many unmatched")
            failure = Failure(msg.sender_request_id, msg.request_id, *self._me, "full")
            self._reply(sender, failure, msg.contact)
        else:
            self._pending.add(msg, sender, self._now)

    def _refuse_draining(self, msg: Registration, sender: str) -> None:
        """Tell D at once that this engine drains: D fails the request over (vLLM recomputes
        the prompt) instead of waiting out its watchdog."""
        self.counters["refused_draining"] += 1
        failure = Failure(msg.sender_request_id, msg.request_id, *self._me, "draining")
        self._reply(sender, failure, msg.contact)

    def _on_cancel(self, msg: Cancel, sender: str) -> None:
        key = (sender, msg.sender_request_id)
        if msg.contact:
            self._peer_of(sender, msg.contact)  # where to acknowledge, if D never registered
        # Whatever happens below, P acknowledges; a registration this cancel overtook (the
        # network reorders) must then never be matched.
        self._consumed.add(_consumer_key(*key), _CANCELLED)
        req = self._by_consumer.get(key)
        if req is None and key in self._pending:
            self._pending.drop(key)  # withdrawn before anything was posted for it
            self.counters["registration_withdrawn"] += 1
        elif req is None:
            # D never registered (a full prefix-cache hit, or it gave up first): find the request
            # the way a registration would, but only one nobody registered for yet.
            req = self._match(msg)
            req = req if req is not None and not req.links else None
        if req is not None:
            self._sender, self._cancel = sender, msg  # for the commands this cancel runs
            try:
                self._fire_from_peer(req, "peer_cancelled")
            finally:
                self._sender, self._cancel = "", None
            return
        if key not in self._pending and msg.request_id in self.tombstones:
            self._count_error("late", f"cancel for ended request {msg.request_id!r}")
        elif key not in self._pending:
            self._count_error("unknown", f"cancel for {msg.sender_request_id!r} from {sender}")
        if self.mode == "push":  # nothing of it is posted to the sender: confirm at once
            self._reply(sender, CancelAck(msg.sender_request_id, msg.request_id, *self._me))

    def _on_completion(self, msg: Completion, sender: str) -> None:
        req = self._by_consumer.get((sender, msg.sender_request_id))
        link = req.links.get(sender) if req is not None else None
        if req is None or link is None or not link.granted:
            ended = msg.request_id in self.tombstones
            self._count_error("late" if ended else "unknown", f"completion {msg.request_id!r}")
            return
        self._tally_result(req, sender, True)

    def _on_heartbeat(self, msg: Heartbeat, sender: str) -> None:
        for rid in msg.request_ids:
            req = self._by_consumer.get((sender, rid))
            if req is None:
                self.counters["heartbeat_unknown"] += 1
            else:
                self._fire_from_peer(req, "heartbeat")

    # --- lost completions: P answers D (push), P asks D (pull) ---------------------------------

    def transfer_status(
        self, asker: str, asker_request_id: str, request_id: str = ""
    ) -> TransferStatus:
        """D asks with its id for the request: what became of P's WRITE into its blocks. Only
        the request D's registration was matched to answers for it (never one found by id
        alone: that could be another's transfer)."""
        req = self._by_consumer.get((asker, asker_request_id))
        if req is not None:
            link = req.links[asker]
            if link.given_up:
                return "failed"
            return link_status(link.ok, bool(link.transfer_id or link.granted))
        if (asker, asker_request_id) in self._pending:
            return "waiting"
        matched = self._consumed.get(_consumer_key(asker, asker_request_id))
        ended = None if matched in (None, _CANCELLED) else self.tombstones.get(matched)
        if ended is None:
            return "failed" if matched == _CANCELLED else "unknown"
        return "done" if ended == "done" else "failed"  # done: every WRITE of it completed

    def _take_answer(self, req: Request, peer: str, status: TransferStatus) -> None:
        if status == "done":  # as if its completion had come
            self.counters["recovered"] += 1
            self._tally_result(req, peer, True)
        elif status in ("failed", "unknown"):  # D reads no more: the blocks are free
            self._tally_result(req, peer, False)

    def _asks_about(self, link: ConsumerLink) -> bool:
        return self.mode == "pull" and link.granted

    def _ask_bound_s(self) -> float:
        return self.config.producer_stall_s

    # --- matching -------------------------------------------------------------------------------

    def _match(self, msg: Registration | Cancel) -> Request | None:
        """The request a message from D is about, O(1): the P id D named, exactly; if D named
        none, D's own id, then its base id (D's and P's ids differ in a random suffix)."""
        if msg.request_id:
            return self._waiting.get(msg.request_id)
        req = self._waiting.get(msg.sender_request_id)
        if req is not None:
            return req
        held = self._waiting_base.get(base_request_id(msg.sender_request_id))
        if held is None or isinstance(held, Request):
            return held
        return next(iter(held.values()))  # the first admitted

    def _attach(self, req: Request, msg: Registration, sender: str) -> None:
        try:
            expected = len(paired_ranks(self.identity.rank, self.identity.tp_size, msg.tp_size))
        except ValueError as exc:
            self._count_error("rejected", f"registration from {sender}: {exc}")
            return
        if sender in req.links:
            self._count_error("duplicate", f"registration for {req.id!r} from {sender}")
            return
        self._peer_of(sender, msg.contact)  # where to handshake back with D
        self._evict_if_restarted(sender, msg.incarnation)
        blocks = unpack_blocks(msg.block_ids)
        req.links[sender] = ConsumerLink(
            sender, msg.sender_request_id, blocks, msg.deadline, incarnation=msg.incarnation
        )
        req.peers += (sender,)
        req.tally.expected = expected
        self._by_consumer[(sender, msg.sender_request_id)] = req
        self._consumed.add(_consumer_key(sender, msg.sender_request_id), req.id)
        if len(req.links) >= expected:
            self._unwait(req)
        self._fire_from_peer(req, "registration")

    def _evict_if_restarted(self, agent: str, incarnation: int) -> None:
        """A later process of `agent` registered than our connection reaches: the old one is
        gone. Drop the connection (requests it served fail) so this one handshakes afresh."""
        peer = self.peers[agent]
        if peer.state == "connected" and 0 < peer.incarnation < incarnation:
            self._count_error("peer_restarted", f"{agent}: {peer.incarnation} -> {incarnation}")
            self._peer_event(agent, "peer_lost")

    def _wait(self, req: Request) -> None:
        """Index `req` as taking registrations, by id and by base id."""
        self._waiting[req.id] = req
        held = self._waiting_base.get(req.base_id)
        if held is None:
            self._waiting_base[req.base_id] = req
        elif isinstance(held, Request):
            if held is not req:  # (a withdrawn registration re-indexes a request still waiting)
                self._waiting_base[req.base_id] = {held.id: held, req.id: req}
        else:
            held[req.id] = req

    def _unwait(self, req: Request) -> None:
        if self._waiting.pop(req.id, None) is None:
            return
        held = self._waiting_base[req.base_id]
        if isinstance(held, Request):
            del self._waiting_base[req.base_id]
            return
        del held[req.id]
        if len(held) == 1:
            self._waiting_base[req.base_id] = next(iter(held.values()))

    def _forget(self, req: Request) -> None:
        super()._forget(req)
        self._unwait(req)
        self._ended_bases.add(req.base_id, req.state)
        for link in req.links.values():
            self._by_consumer.pop((link.agent, link.request_id), None)

    # --- guards and commands named in models/producer_*.toml -----------------------------------

    @property
    def _me(self) -> tuple[int, int]:
        return self.identity.rank, self.identity.tp_size

    def _req_cmd_arm_lease(self, req: Request) -> None:
        self._arm(req, "arm_lease", self.config.lease_s)

    def _req_cmd_arm_stall(self, req: Request) -> None:
        self._arm(req, "arm_stall", self.config.producer_stall_s)

    def _req_cmd_post_transfer(self, req: Request) -> None:
        for link in req.links.values():
            if link.transfer_id or link.given_up or not self._connected((link.agent,)):
                continue
            if self._stale(link.agent, link.incarnation):
                self._give_up(req, link)
                continue
            link.transfer_id = tid = self._new_transfer_id()
            self._transfers[tid] = (req.id, link.agent)
            # D may have given up and be fencing already (its deadline is on D's clock)
            if self._now >= self._local_time(link.agent, link.deadline):
                self._count_error("rejected", f"{req.id}: D's registration deadline passed")
                self._transfers.pop(tid)
                self._tally_result(req, link.agent, False)
                continue
            self._send(link.agent, Progress(link.request_id, req.id, *self._me))
            checksum = self.config.checksums(req.id)
            done = encode(
                Completion(
                    link.request_id,
                    req.id,
                    *self._me,
                    sender_blocks=len(req.blocks) if checksum else 0,
                )
            )
            # All of P's blocks and all of D's: the runtime pairs D's (after its prefix-cache
            # hit) with P's last ones, by the two block sizes, or fails the post.
            self._emit(
                PostTransfer(
                    req.id, tid, "WRITE", link.agent, req.blocks, link.block_ids, done, checksum
                )
            )

    def _tell_peers_abandoned(self, req: Request) -> None:
        self._req_cmd_notify_peer_failed(req)

    def _abandon_hold_s(self) -> float:
        # A granted READ ends before the grant's deadline, at most P's stall bound from now.
        return self.config.producer_stall_s + self.transport_drain_s

    def _req_cmd_fail_lost_links(self, req: Request) -> None:
        for link in req.links.values():
            untouched = not link.transfer_id and not link.granted
            if link.agent in req.lost and untouched and not link.given_up:
                self._give_up(req, link)

    def _give_up(self, req: Request, link: ConsumerLink) -> None:
        """Fail one D rank's share, before anything was posted or granted to it."""
        link.given_up = True
        self._tally_result(req, link.agent, False)

    def _req_cmd_notify_peer_failed(self, req: Request) -> None:
        # A lease cut short by the drain says so: D fails over, knowing why.
        reason = "draining" if self.draining and req.state == "expired" else req.state
        for link in req.links.values():
            self._reply(link.agent, Failure(link.request_id, req.id, *self._me, reason))

    def _req_cmd_ack_cancel(self, req: Request) -> None:
        # Every D rank of the request, and the one whose cancel is being handled (it may have
        # no link: a request it never registered for).
        agents = {link.agent: link.request_id for link in req.links.values()}
        if self._cancel is not None:
            agents.setdefault(self._sender, self._cancel.sender_request_id)
        for agent, d_id in agents.items():
            self._reply(agent, CancelAck(d_id, req.id, *self._me))

    def _req_cmd_grant_read(self, req: Request) -> None:
        blocks = pack_blocks(req.blocks)
        # D's READ, cancelled at worst `stall_s` after it is posted, must end before P may release
        # the blocks (`producer_stall_s` from now): D posts only before this deadline.
        deadline = self._now + self.config.producer_stall_s - self.config.stall_s
        for link in req.links.values():
            if link.granted or link.given_up or not self._connected((link.agent,)):
                continue
            if self._stale(link.agent, link.incarnation):
                self._give_up(req, link)
            else:
                link.granted = True
                grant = Grant(
                    link.request_id, req.id, *self._me, blocks, deadline, self.incarnation
                )
                of = (req.blocks, link.block_ids) if self.config.checksums(req.id) else None
                self._emit(SendNotification(link.agent, encode(grant), of))

    def _engine_cmd_stop_intake(self, _engine: EngineRecord) -> None:
        # Registrations parked for requests P never admitted: refused now (P admits no more).
        for sender, d_id, _ in self._pending.items():
            entry = self._pending.drop((sender, d_id))
            self._refuse_draining(entry.message, sender)
        # Blocks held under a lease with no transfer started: released now, D hears
        # `draining` (docs/lifecycles.md); a lease would otherwise hold the drain up to
        # `lease_s`.
        for req in list(self.requests.values()):
            if req.state in _LEASED:
                self._runq.post(self._req, req, "intake_stopped")

    def _req_guard_consumer_released(self, req: Request) -> bool:
        return req.consumer_released

    def _req_cmd_note_release(self, req: Request) -> None:
        req.consumer_released = True

    def _req_cmd_drop_registration(self, req: Request) -> None:
        # D's ranks give up together: one rank's cancel withdraws every rank's registration.
        for link in req.links.values():
            self._by_consumer.pop((link.agent, link.request_id), None)
        self._stop_waiting(req)  # else P's connection to D, once up, wakes a request in `leased`
        req.links, req.peers = {}, ()
        req.tally = TransferTally(req.id, 1)
        self._wait(req)

    def _req_cmd_record_cancel(self, req: Request) -> None:
        if self._sender in req.links:
            self._tally_result(req, self._sender, False)


_CANCELLED = "cancelled"
_LEASED = frozenset(("leased", "matched"))  # blocks held under a lease, nothing posted or granted


def _consumer_key(agent: str, request_id: str) -> str:
    return f"{agent}\x00{request_id}"
