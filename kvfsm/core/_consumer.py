"""The decode side (D): register the blocks to fill, receive P's WRITEs (push) or READ once granted
(pull), report the blocks received or invalid, and never hand back blocks a transfer may still fill."""

from __future__ import annotations

from collections import defaultdict
from typing import ClassVar

import msgspec
import numpy as np

from kvfsm.core._config import CoreConfig, Identity, Mode, agent_name, paired_ranks
from kvfsm.core._deadlines import earliest
from kvfsm.core._io import (
    Admit,
    BlocksVerified,
    PostTransfer,
    ReportFailed,
    ReportReceived,
    Tick,
    TransferStatus,
    VerifyBlocks,
)
from kvfsm.core._records import Request, link_status
from kvfsm.core._side import Side, SideSnapshot
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
    encode,
    pack_blocks,
    unpack_blocks,
)

__all__ = ["Consumer", "ProducerLink"]

_NO_BLOCKS: BlockIds = np.zeros(0, dtype=np.int32)
_HEARTBEAT_BATCH = 4096  # ids per heartbeat notification, far below the message size bound
_HEARTBEAT_STATES = frozenset({"registered", "writing", "reading"})
_MAX_PEER_ENGINES = 1024  # P engines whose rank agents are remembered (bounded memory)


class ProducerLink(msgspec.Struct, gc=False):
    """One P rank's part in a D request: its grant (pull) and the READ posted from it."""

    agent: str
    request_id: str = ""  # P's id for the request, once known
    block_ids: BlockIds = _NO_BLOCKS
    deadline: float = 0.0  # push: what D told P (no WRITE after); pull: P's grant deadline
    transfer_id: int = 0
    incarnation: int = 0  # pull: the P process that granted (0: unknown)
    ok: bool | None = None  # its transfer's result, once counted
    checksum: int | None = None  # pull: of the bytes its grant lets D read (verify on)


class Consumer(Side):
    """D's side of every request, both modes. Feed events with `handle(event, now)`."""

    side: ClassVar[str] = "D"
    _deadline_events: ClassVar[dict[str, str]] = {
        "arm_watchdog": "watchdog_expired",
        "arm_stall": "stall_timeout",
        "arm_fence": "fence_expired",
    }

    def __init__(self, identity: Identity, mode: Mode, config: CoreConfig | None = None) -> None:
        super().__init__(identity, mode, config)
        self._next_heartbeat = 0.0
        self._peer_agents: dict[tuple[str, int], tuple[str, ...]] = {}  # (P engine, TP) -> agents
        self._handlers[Admit] = self._on_admit
        self._handlers[Tick] = self._on_d_tick
        self._handlers[BlocksVerified] = self._on_blocks_verified
        self._messages.update(
            {
                Progress: self._on_progress,
                Completion: self._on_completion,
                Failure: self._on_failure,
                CancelAck: self._on_cancel_ack,
                Grant: self._on_grant,
            }
        )

    # --- caller events --------------------------------------------------------------------------

    def _on_admit(self, event: Admit) -> None:
        peers = self._peer_agents.get((event.peer_engine, event.peer_tp))
        if peers is None:
            peers = self._peers_of(event.peer_engine, event.peer_tp)
        if len(event.blocks) and not event.peer_engine:
            raise ValueError(f"request {event.request_id!r} has blocks to receive but no P engine")
        req = self._new_request(event.request_id, event.blocks)
        req.peer_request_id = event.peer_request_id
        req.peers = peers
        if event.peer_contact:  # every rank of P answers handshakes at P's one side channel
            for agent in req.peers:
                self._peer_of(agent, event.peer_contact)
        req.links = {a: ProducerLink(a, event.peer_request_id) for a in req.peers}
        req.tally.expected = len(req.peers)
        self._req.fire(req, "admitted", self._now)

    def _peers_of(self, engine: str, peer_tp: int) -> tuple[str, ...]:
        """The agents of P's ranks this rank pairs with, computed once per P engine and TP size
        (requests then share the tuple instead of building their own)."""
        ranks = paired_ranks(self.identity.rank, self.identity.tp_size, peer_tp)
        peers = tuple(agent_name(engine, r) for r in ranks) if engine else ()
        if len(self._peer_agents) < _MAX_PEER_ENGINES:
            self._peer_agents[(engine, peer_tp)] = peers
        return peers

    def snapshot(self) -> SideSnapshot:
        """The side's bookkeeping, with D's next heartbeat."""
        return super().snapshot()._replace(next_heartbeat=self._next_heartbeat)

    def next_wakeup(self) -> float | None:
        """When the next deadline or heartbeat falls (O(1): with requests live, the next
        heartbeat time counts even if none of them is in a state that sends one)."""
        at = super().next_wakeup()
        return earliest(at, self._next_heartbeat) if self.requests else at

    def _on_d_tick(self, event: Tick) -> None:
        self._on_tick(event)
        if self._now >= self._next_heartbeat:
            self._next_heartbeat = self._now + self.config.heartbeat_s
            self._send_heartbeats()

    def _send_heartbeats(self) -> None:
        by_peer: defaultdict[str, list[str]] = defaultdict(list)
        for req in self.requests.values():
            if req.state in _HEARTBEAT_STATES:
                for agent in req.peers:
                    by_peer[agent].append(req.id)
        for agent, ids in by_peer.items():
            if self._connected((agent,)):
                for i in range(0, len(ids), _HEARTBEAT_BATCH):
                    self._send(agent, Heartbeat(ids[i : i + _HEARTBEAT_BATCH], self.identity.rank))

    # --- messages from P ------------------------------------------------------------------------

    def _request_from(self, request_id: str, sender: str, what: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and sender in req.links:
            return req
        if req is not None:
            self._count_error("unexpected", f"{what} for {request_id!r} from stranger {sender}")
        else:
            kind = "late" if request_id in self.tombstones else "unknown"
            self._count_error(kind, f"{what} for {request_id!r} from {sender}")
        return None

    def _on_progress(self, msg: Progress, sender: str) -> None:
        req = self._request_from(msg.request_id, sender, "progress")
        if req is not None:
            self._fire_from_peer(req, "peer_writing")

    def _on_completion(self, msg: Completion, sender: str) -> None:
        req = self._request_from(msg.request_id, sender, "completion")
        if req is None:
            return
        if msg.checksum is not None and self.config.verify != "off":
            # P's WRITE landed; its bytes count once they match P's checksum.
            p_blocks = np.zeros(msg.sender_blocks, dtype=np.int32)  # only their count pairs
            self._emit(VerifyBlocks(req.id, sender, msg.checksum, req.blocks, p_blocks))
            return
        self._result_from_peer(req, sender, True)

    def _on_failure(self, msg: Failure, sender: str) -> None:
        req = self._request_from(msg.request_id, sender, "failure")
        if req is None:
            return
        if self.mode == "push":
            # P sends this only once none of its WRITEs can still land.
            self._result_from_peer(req, sender, False)
        else:
            self._fire_from_peer(req, "peer_failed")

    def _on_cancel_ack(self, msg: CancelAck, sender: str) -> None:
        req = self._request_from(msg.request_id, sender, "cancel ack")
        if req is None:
            return
        req.acks |= {sender}
        if (req.acks | req.lost).issuperset(req.peers):
            self._fire_from_peer(req, "cancel_acked")

    def _on_grant(self, msg: Grant, sender: str) -> None:
        req = self._request_from(msg.request_id, sender, "grant")
        if req is None:
            return
        link = req.links[sender]
        if link.transfer_id:
            self._count_error("duplicate", f"grant for {req.id!r} from {sender}")
            return
        deadline = self._local_time(sender, msg.deadline)  # P's clock, taken early on ours
        if self._now > deadline:
            # Too late to read safely: P may release its blocks before a READ posted now ends.
            self._count_error("grant_expired", f"grant for {req.id!r} from {sender}")
            self._fire_from_peer(req, "peer_failed")
            return
        link.request_id = msg.sender_request_id
        link.block_ids = unpack_blocks(msg.block_ids)
        link.deadline = deadline
        link.incarnation = msg.incarnation
        link.checksum = msg.checksum
        self._fire_from_peer(req, "peer_granted")

    def _transfer_ended(self, req: Request, peer: str, ok: bool) -> None:
        link = req.links.get(peer)
        if ok and link is not None and link.checksum is not None and self.config.verify != "off":
            # Our READ ended; its bytes count once they match P's checksum.
            self._emit(VerifyBlocks(req.id, peer, link.checksum, req.blocks, link.block_ids))
            return
        self._tally_result(req, peer, ok)

    def _on_blocks_verified(self, event: BlocksVerified) -> None:
        req = self.requests.get(event.request_id)
        if req is None or event.peer not in req.links:
            self._count_error("late", f"verification of {event.request_id!r} after it ended")
            return
        if not event.ok:
            self._count_error("corrupted", f"{req.id}: bytes from {event.peer} fail its checksum")
        else:
            self.counters["verified"] += 1
        if self.mode == "push":
            self._result_from_peer(req, event.peer, event.ok)
        else:
            self._tally_result(req, event.peer, event.ok)

    def _result_from_peer(self, req: Request, sender: str, ok: bool) -> None:
        event = "transfer_complete" if ok else "transfer_failed"
        if not self._req.accepts(req.state, event):
            self._count_error("protocol_error", f"{event} for {req.id!r} in {req.state}")
            return
        self._tally_result(req, sender, ok)

    # --- lost completions: D asks P (push), D answers P (pull) ---------------------------------

    def transfer_status(
        self, asker: str, asker_request_id: str, request_id: str = ""
    ) -> TransferStatus:
        """P asks with our id for the request (`request_id`, from our registration): what
        became of our READ from it."""
        req = self.requests.get(request_id)
        if req is not None:
            link = req.links.get(asker)
            return "unknown" if link is None else link_status(link.ok, bool(link.transfer_id))
        ended = self.tombstones.get(request_id) if request_id else None
        if ended is None:
            return "unknown"
        return "done" if ended == "done" else "failed"  # done: every READ of it completed

    def _take_answer(self, req: Request, peer: str, status: TransferStatus) -> None:
        if status == "done":  # as if its completion had come
            self.counters["recovered"] += 1
            self._result_from_peer(req, peer, True)
        elif status == "failed":  # as P's failure notice: none of its WRITEs can still land
            self._result_from_peer(req, peer, False)
        elif status == "transferring":
            self._fire_from_peer(req, "peer_writing")
        elif status == "unknown":  # our registration may still reach P: fence, do not free
            self._fire_from_peer(req, "peer_denied")

    def _asks_about(self, link: ProducerLink) -> bool:
        return self.mode == "push" and link.deadline > 0  # told P where to write

    def _ask_bound_s(self) -> float:
        return self.config.watchdog_s

    # --- guards and commands named in models/consumer_*.toml -----------------------------------

    def _req_cmd_arm_watchdog(self, req: Request) -> None:
        self._arm(req, "arm_watchdog", self.config.watchdog_s)

    def _req_cmd_arm_stall(self, req: Request) -> None:
        self._arm(req, "arm_stall", self.config.stall_s)

    def _req_cmd_arm_fence(self, req: Request) -> None:
        # P posts no WRITE after the deadline in our registration and cancels any by its stall
        # bound: past both, nothing can land, whatever was lost on the way.
        last_write = (
            max(link.deadline for link in req.links.values()) + self.config.producer_stall_s
        )
        at = max(self._now + self.config.fence_s, last_write)
        self.deadlines.arm(req.id, at, self._deadline_events["arm_fence"])

    def _req_cmd_send_registration(self, req: Request) -> None:
        me = self.identity
        blocks = pack_blocks(req.blocks)
        deadline = self._now + self.config.watchdog_s
        for link in req.links.values():
            link.deadline = deadline
            reg = Registration(
                req.peer_request_id,
                req.id,
                me.rank,
                me.tp_size,
                me.engine_id,
                blocks,
                deadline,
                me.contact,
                self.incarnation,
            )
            self._send(link.agent, reg)

    def _req_cmd_send_cancel(self, req: Request) -> None:
        me = self.identity
        for link in req.links.values():
            # Queued until connected if the handshake is still under way: P then lets go of its
            # blocks at once instead of holding them for its lease.
            cancel = Cancel(link.request_id, req.id, me.rank, me.tp_size, me.contact)
            self._reply(link.agent, cancel)

    def _req_cmd_post_transfer(self, req: Request) -> None:
        me = self.identity
        for link in req.links.values():
            if link.transfer_id or not len(link.block_ids):
                continue
            if self._stale(link.agent, link.incarnation):
                self._tally_result(req, link.agent, False)
                continue
            link.transfer_id = tid = self._new_transfer_id()
            self._transfers[tid] = (req.id, link.agent)
            done = encode(Completion(link.request_id, req.id, me.rank, me.tp_size))
            # The runtime pairs our blocks with P's last ones by the two block sizes (a
            # prefix-cache hit left us fewer), or fails the post when P granted too few.
            self._emit(
                PostTransfer(req.id, tid, "READ", link.agent, req.blocks, link.block_ids, done)
            )

    def _may_still_land(self, req: Request) -> bool:
        # release_blocks is never the success path (that is report_received): once P was told
        # where to WRITE (push) or a READ was posted (pull), bytes may be on their way.
        if self.mode == "push":
            return any(link.deadline for link in req.links.values())
        return any(link.transfer_id for link in req.links.values())

    def _req_guard_peer_lost(self, req: Request) -> bool:
        return bool(req.lost)

    def _req_cmd_check_fence(self, req: Request) -> None:
        # A lost P rank's WRITE can neither complete nor land any more: its result is a failure
        # and it counts as having acknowledged the cancel.
        for agent in req.lost.difference(req.tally.reported):
            self._tally_result(req, agent, False)
        if (req.acks | req.lost).issuperset(req.peers):
            self._runq.post(self._req, req, "cancel_acked")

    def _req_cmd_report_received(self, req: Request) -> None:
        req.reported = req.released = True  # the blocks are the caller's again
        self._emit(ReportReceived(req.id, req.blocks))

    def _req_cmd_report_failed(self, req: Request) -> None:
        req.reported = True
        self._emit(ReportFailed(req.id, req.blocks))

    def _tell_peers_abandoned(self, req: Request) -> None:
        if not req.reported:
            self._req_cmd_report_failed(req)
        self._req_cmd_send_cancel(req)

    def _abandon_hold_s(self) -> float:
        # P may post a WRITE until D's registration deadline (at most a watchdog away), and a
        # posted one ends within P's stall bound; the fence bound covers that, as for a cancel.
        c = self.config
        return c.watchdog_s + c.fence_s + self.transport_drain_s
