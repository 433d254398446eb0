"""A cluster of real NIXL agents and the real ZMQ side channel on a virtual clock, brought to rest
after every operation, so that it runs a program step by step beside a simulated cluster.

Every rank is an `Engine` in this process with its own NIXL agent (UCX error handling "peer",
its TCP transport on) and its own `ZmqDirectory`; one `HandshakeListener` on 127.0.0.1 answers
for every rank, as one side channel answers for all ranks of an engine. The engines' clock is
the one passed in (the simulated twin's): deadlines fall at the same instants on both. After
each operation `catch_up` polls every live engine until nothing is on its way: no handshake
under way, no transfer to a live peer in progress, every notification sent to a live rank
received (counted per pair as NIXL hands them over).

The faults are what this real fabric produces: a rank killed (its agent closed; in one process
its peers see silence, as from a cut link: transfers to it stay in progress, notifications
vanish, the side channel answers no more for it), a rank revived under its name, a handshake
refused (the listener's refusal) or hung (started only once the clock passed its hold), and a
post NIXL refuses (armed on the agent: the one fault raised here rather than by NIXL, which has
no way to make a healthy post fail on demand).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfsm.core import Mode, TransferStatus
from kvfsm.fabric import DlistHandle, FabricError, NixlFabric, XferHandle, XferOp, XferState
from kvfsm.runtime import Directory, Engine, HandshakeError, PeerInfo, StatusQuery
from kvfsm.sidechannel import (
    HandshakeListener,
    HandshakePayload,
    ZmqDirectory,
    compat_hash,
    payload_of,
)
from kvfsm.sim._cluster import Cluster
from kvfsm.wire import WIRE_VERSION

__all__ = ["LockstepCluster"]

_REST_S = 20.0  # how long the real fabric may take to come to rest: a hang bound, not a timing
_HANDSHAKE_S = 60.0  # the side channel's timeout (a hung handshake is held before it starts)


class _Traffic:
    """Notifications per (sender, receiver): sent, and taken by the receiver."""

    def __init__(self) -> None:
        self.sent: Counter[tuple[str, str]] = Counter()
        self.got: Counter[tuple[str, str]] = Counter()

    def on_the_way(self, dead: set[str]) -> list[tuple[str, str]]:
        return [k for k, n in self.sent.items() if k[1] not in dead and self.got[k] != n]


class _CountedNixl(NixlFabric):
    """A real NIXL agent whose notifications are counted (a transfer's once it is DONE), whose
    next posts can be armed to be refused, and whose posts to a live peer complete within the
    post, as on SimFabric without latency: the post drives both agents until NIXL says DONE or
    ERR (the peer's notifications are kept for its next `get_new_notifs`)."""

    def __init__(self, name: str, traffic: _Traffic, live: dict[str, _CountedNixl]) -> None:
        super().__init__(name, ucx_error_handling="peer")
        self._traffic = traffic
        self._live = live  # the cluster's live agents, by name
        self._arrived: dict[str, list[bytes]] = {}  # taken from NIXL during this round
        self._ready: dict[str, list[bytes]] = {}  # for the engine in this round
        self._dlist_peer: dict[int, str] = {}
        self._target: dict[int, str] = {}  # transfer -> its peer
        self._notifying: dict[int, str] = {}  # transfer with a notification -> its peer
        self.refuse_posts = 0

    def prep_xfer_dlist(self, agent: str | None, descs: Any) -> DlistHandle:
        handle = super().prep_xfer_dlist(agent, descs)
        if agent is not None:
            self._dlist_peer[handle] = agent
        return handle

    def make_prepped_xfer(
        self,
        op: XferOp,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int64],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int64],
        notif: bytes,
        *,
        merge: bool = True,
    ) -> XferHandle:
        handle = super().make_prepped_xfer(
            op, local, local_idx, remote, remote_idx, notif, merge=merge
        )
        self._target[handle] = self._dlist_peer[remote]
        if notif:
            self._notifying[handle] = self._target[handle]
        return handle

    def make_xfer(
        self, op: XferOp, local: Any, agent: str, remote: Any, notif: bytes
    ) -> XferHandle:
        handle = super().make_xfer(op, local, agent, remote, notif)
        self._target[handle] = agent
        if notif:
            self._notifying[handle] = agent
        return handle

    def transfer(self, handle: XferHandle) -> XferState:
        if self.refuse_posts:
            self.refuse_posts -= 1
            self._notifying.pop(handle, None)
            raise FabricError(f"{self.agent_name}: post refused (armed fault)")
        state = super().transfer(handle)
        peer = self._live.get(self._target.get(handle, ""))
        until = time.monotonic() + _REST_S
        while state == "PROC" and peer is not None and time.monotonic() < until:
            peer.progress()
            state = super().check_xfer_state(handle)
        return self._counted(handle, state)

    def progress(self) -> None:
        """Let NIXL progress this agent; what notifications it brings wait for the next round
        (on SimFabric a message takes a step: none is read in the round that sent it)."""
        for sender, messages in super().get_new_notifs().items():
            self._arrived.setdefault(sender, []).extend(messages)
            self._traffic.got[(sender, self.agent_name)] += len(messages)

    def open_round(self) -> None:
        """What arrived so far is the engine's to take in the round that begins."""
        for sender, messages in self._arrived.items():
            self._ready.setdefault(sender, []).extend(messages)
        self._arrived = {}

    @property
    def holding(self) -> bool:
        """Notifications taken from NIXL and not yet by the engine."""
        return bool(self._arrived or self._ready)

    def check_xfer_state(self, handle: XferHandle) -> XferState:
        return self._counted(handle, super().check_xfer_state(handle))

    def release_xfer_handle(self, handle: XferHandle) -> None:
        self._notifying.pop(handle, None)
        self._target.pop(handle, None)
        super().release_xfer_handle(handle)

    def _counted(self, handle: XferHandle, state: XferState) -> XferState:
        if state == "DONE" and handle in self._notifying:
            self._traffic.sent[(self.agent_name, self._notifying.pop(handle))] += 1
        return state

    def send_notif(self, agent: str, msg: bytes) -> None:
        super().send_notif(agent, msg)
        self._traffic.sent[(self.agent_name, agent)] += 1

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """The notifications of this round (see `progress`)."""
        notifs, self._ready = self._ready, {}
        return notifs


class _Handshakes:
    """One engine's handshakes over the real side channel; a hung one starts once the clock
    passes its hold. Results are handed over together once none is under way, in the order
    the handshakes started (as on SimFabric), not in the order the side channel's threads
    happen to finish them."""

    def __init__(self, zmq: ZmqDirectory, cluster: LockstepCluster) -> None:
        self.zmq = zmq
        self._cluster = cluster
        self._held: list[tuple[float, str, str]] = []
        self._order: list[str] = []  # peers, as their handshakes started
        self._done: dict[str, PeerInfo | HandshakeError] = {}
        self.started = self.answered = 0

    def start(self, peer: str, contact: str = "") -> None:
        c = self._cluster
        hold = 0.0
        if c.hangs[peer]:  # counted, with one hold per agent: as `LocalDirectory.hang_next`
            c.hangs[peer] -= 1
            hold = c.hang_s[peer]
        if c.refusals[peer]:  # taken by the handshake that starts next, as on SimFabric
            c.refusals[peer] -= 1
            contact = f"127.0.0.1:{c.refuser.port}"
        if hold:
            self._held.append((c.now + hold, peer, contact))
        else:
            self._start(peer, contact)

    def release(self, now: float) -> None:
        due = [h for h in self._held if h[0] <= now]
        self._held = [h for h in self._held if h[0] > now]
        for _, peer, contact in due:
            self._start(peer, contact)

    def _start(self, peer: str, contact: str) -> None:
        self.started += 1
        self._order.append(peer)
        self.zmq.start(peer, contact)

    def ask(self, peer: str, query: StatusQuery) -> None:
        # Real time decides when an answer comes: the twin runs with status_query_s=0, so
        # only tests outside it ask (kvfsm.testing.twin says why).
        self.zmq.ask(peer, query)

    def answers(self) -> list[tuple[StatusQuery, TransferStatus]]:
        return self.zmq.answers()

    def results(self) -> list[tuple[str, PeerInfo | HandshakeError]]:
        self._done.update(self.zmq.results())
        if len(self._done) < len(self._order):
            return []
        out = [(peer, self._done[peer]) for peer in self._order]
        self._order, self._done = [], {}
        self.answered += len(out)
        return out


class LockstepCluster(Cluster):
    """A `Cluster` on real NIXL and ZMQ whose engines read `clock` (e.g. a simulated twin's
    `now`); call `catch_up` after each operation and after the clock moved."""

    def __init__(self, mode: Mode, *, clock: Callable[[], float], **options: Any) -> None:
        self._clock = clock
        self.traffic = _Traffic()
        self._fabrics: dict[str, _CountedNixl] = {}  # live agents
        self.hangs: Counter[str] = Counter()  # agent -> next handshakes with it to hang
        self.hang_s: dict[str, float] = {}  # agent -> how long they hang
        self.refusals: Counter[str] = Counter()  # agent -> next handshakes with it refused
        self.refuser = HandshakeListener(lambda _agent: None)  # a side channel that refuses
        self._payloads: dict[str, HandshakePayload] = {}
        self._lock = threading.Lock()
        self._handshakes: dict[str, _Handshakes] = {}
        self._listener: HandshakeListener | None = None
        self._hash = ""
        super().__init__(mode, fabric="nixl", ucx_error_handling="peer", **options)

    @property
    def now(self) -> float:
        """The virtual clock's time."""
        return self._clock()

    # --- the real parts ------------------------------------------------------------------------

    def _new_fabric(self, agent: str) -> NixlFabric:
        self._fabrics[agent] = fabric = _CountedNixl(agent, self.traffic, self._fabrics)
        return fabric

    def _side_channel(self) -> HandshakeListener:
        if self._listener is None:
            g = self.geometry["P"]
            self._hash = compat_hash(
                wire_version=WIRE_VERSION, mode=self.mode, model="lockstep", dtype="u8", geometry=g
            )
            self._listener = HandshakeListener(
                self._answer,
                clock=lambda: self.now,
                guests=self.directory.guests,
                secret=self.secret,
            )
        return self._listener

    def _answer(self, agent: str) -> HandshakePayload | None:
        """The listener's answer for `agent` (on its thread): its payload (None: refused)."""
        with self._lock:
            return self._payloads.get(agent)

    def _new_directory(self, agent: str, clock: Callable[[], float]) -> Directory:
        port = self._side_channel().port
        zmq = ZmqDirectory(
            lambda _peer: ("127.0.0.1", port),
            compat_hash=self._hash,
            wire_version=WIRE_VERSION,
            timeout_s=_HANDSHAKE_S,
            clock=clock,
            requester=agent,
            secret=self.secret,
        )
        old = self._handshakes.pop(agent, None)
        if old is not None:
            old.zmq.close()
        self._handshakes[agent] = handshakes = _Handshakes(zmq, self)
        return handshakes

    def _publish(self, engine: Engine, clock: Callable[[], float]) -> None:
        payload = payload_of(engine, compat_hash=self._hash, wire_version=WIRE_VERSION)
        with self._lock:
            self._payloads[engine.agent] = payload

    # --- faults --------------------------------------------------------------------------------

    def kill(self, agent: str, reset: bool = False) -> None:
        """`agent`'s process is gone: nothing answers for it, its agent is closed. Its peers
        see silence (`reset` cannot be had in one process)."""
        if agent in self.dead:
            return
        with self._lock:
            self._payloads.pop(agent, None)
        self.dead.add(agent)
        del self._fabrics[agent]
        self.engines[agent].fabric.close()
        self.ledger.forget_engine(agent)

    def refuse_next_handshake(self, agent: str) -> None:
        """The next handshake with `agent` is refused (sent to a side channel that refuses)."""
        self.refusals[agent] += 1

    def revive(self, agent: str) -> None:
        """Not here: peers of a closed in-process agent keep its connection silent, where a
        new process's would reset (the simulated fabric revives)."""
        raise NotImplementedError(self.revive.__doc__)

    def hang_next_handshake(self, agent: str, seconds: float) -> None:
        """The next handshake with `agent` answers `seconds` of the clock later (as every
        hang still to come with it)."""
        self.hangs[agent] += 1
        self.hang_s[agent] = seconds

    def refuse_next_post(self, agent: str) -> None:
        """`agent`'s next post is refused."""
        fabric = self.engines[agent].fabric
        assert isinstance(fabric, _CountedNixl)
        fabric.refuse_posts += 1

    # --- time ----------------------------------------------------------------------------------

    def step(self, dt: float) -> None:
        """The clock is not this cluster's to move: `dt` is ignored; the engines catch up."""
        self.catch_up()

    def catch_up(self) -> None:
        """Release the handshakes whose hold passed, then poll every live engine until nothing
        is on its way (AssertionError if the real fabric does not come to rest in time)."""
        until = time.monotonic() + _REST_S
        for agent, handshakes in self._handshakes.items():
            if agent not in self.dead:
                handshakes.release(self.now)
        # Handshakes whose hold ended are answered before the engines poll: on SimFabric their
        # result comes before the deadlines that fall in the same step.
        while any(h.zmq.pending for h in self._handshakes.values()):
            if time.monotonic() > until:
                raise AssertionError("the side channel did not answer")
            time.sleep(1e-4)
        while True:
            self._deliver(until)
            for agent, engine in self.engines.items():
                if agent not in self.dead:
                    engine.poll()
            self.collect()
            busy = self._busy()
            if not busy:
                return
            if time.monotonic() > until:
                raise AssertionError(f"the real fabric did not come to rest: {busy}")
            time.sleep(1e-4)

    def _deliver(self, until: float) -> None:
        """Begin a round: every notification sent to a live rank so far is taken from NIXL,
        and each engine may read it in this round."""
        while self.traffic.on_the_way(self.dead):
            if time.monotonic() > until:
                raise AssertionError(f"undelivered: {self.traffic.on_the_way(self.dead)}")
            for fabric in self._fabrics.values():
                fabric.progress()
        for fabric in self._fabrics.values():
            fabric.open_round()

    def _busy(self) -> list[str]:
        """What is still on its way."""
        busy = [f"notifications {k}" for k in self.traffic.on_the_way(self.dead)]
        busy += [f"{a}: notifications to read" for a, f in self._fabrics.items() if f.holding]
        for agent, engine in self.engines.items():
            if agent in self.dead:
                continue
            h = self._handshakes[agent]
            if h.started != h.answered:
                busy.append(f"{agent}: {h.started - h.answered} handshakes")
            busy += [
                f"{agent}: {f.op} with {f.peer}"
                for f in engine.inflight.values()
                if f.peer not in self.dead
            ]
        return busy

    def close(self) -> None:
        """Close the engines, their agents and directories, and the listener."""
        super().close()
        for handshakes in self._handshakes.values():
            handshakes.zmq.close()
        if self._listener is not None:
            self._listener.close()
        self.refuser.close()
