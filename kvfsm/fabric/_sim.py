"""A deterministic, seeded, virtual-time simulation of the `Fabric` protocol.

A `SimNetwork` holds agents (`SimFabric`) and a virtual clock. Transfers copy real bytes between
registered numpy buffers. Nothing happens on its own: future events (delayed transfer
completions, notification deliveries) wait in a heap ordered by (time, sequence number) and are
processed only inside `SimNetwork.advance_to` (and its helpers `advance`, `run_until_idle`), in
that order, so the same seed and the same calls always give the same outcome.

NIXL behaviours modelled on purpose: metadata is a snapshot (memory registered after
`get_agent_metadata` is invisible to peers until they load fresh metadata); a transfer's
notification arrives strictly after the initiator could see ``"DONE"``; a released handle that
had completed still answers ``"DONE"``; a silent peer leaves transfers in ``"PROC"`` forever;
with `SimFaults.late_delivery`, a transfer released in progress still lands later (UCX over TCP
delivers what its socket held).
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import numpy.typing as npt

from kvfsm.fabric._protocol import (
    DescArray,
    DlistHandle,
    FabricError,
    MemoryHandle,
    NotFoundError,
    RemoteDisconnectedError,
    RepostError,
    XferHandle,
    XferOp,
    XferState,
    XferTelemetry,
)
from kvfsm.fabric._sim_clock import _Completion, _FaultyClock, _LateBytes, _Notif
from kvfsm.fabric._sim_faults import SimFaults
from kvfsm.fabric._sim_rows import (
    I64,
    META_KIND,
    BytesObserver,
    Dlist,
    Meta,
    Region,
    Xfer,
    check_buffer,
    copy_rows,
    indices,
    merged_rows,
    resolve,
    written_ranges,
)

__all__ = ["BytesObserver", "SimFabric", "SimNetwork"]

_NETWORK_IDS = itertools.count(1)  # tells metadata of different networks apart


class SimFabric:
    """One simulated agent; implements `Fabric`. Create it with `SimNetwork.agent`.

    Besides the protocol: `alive`, `in_flight()` and `open_resources()` for tests.
    After `close()` or `SimNetwork.kill`, every protocol method but `close` raises `FabricError`.
    """

    def __init__(self, network: SimNetwork, name: str, gen: int) -> None:
        self._net = network
        self._name = name
        self._gen = gen
        self._down: str | None = None  # None while usable, else "dead" or "closed"
        self._cut = False  # killed with reset=False: its link is cut
        self._superseded = False  # revived: a new process answers on its address
        self._regions: dict[MemoryHandle, Region] = {}
        self._remotes: dict[str, Meta] = {}
        self._dlists: dict[DlistHandle, Dlist] = {}
        self._xfers: dict[XferHandle, Xfer] = {}
        self._released_done: set[XferHandle] = set()
        self._inbox: list[tuple[str, bytes]] = []

    @property
    def late_delivery_s(self) -> float:
        """`SimFaults.late_delivery` of its network."""
        return self._net.faults.late_delivery

    @property
    def agent_name(self) -> str:
        """This agent's name, as peers see it in notifications."""
        return self._name

    @property
    def alive(self) -> bool:
        """False once the agent was closed or killed."""
        return self._down is None

    @property
    def _silent(self) -> bool:
        # A black hole: transfers to it hang, notifications to it vanish, nobody is told.
        return self._cut and not self._superseded

    @property
    def _refuses(self) -> bool:
        # A peer whose host resets connections: operations towards it fail fast.
        return self._down is not None and not self._silent

    def _usable(self) -> None:
        if self._down is not None:
            raise FabricError(f"agent {self._name!r} is {self._down}")

    def _xfer(self, handle: XferHandle) -> Xfer:
        x = self._xfers.get(handle)
        if x is None:
            raise NotFoundError(f"unknown transfer handle {handle} on agent {self._name!r}")
        return x

    def _remote(self, agent: str) -> Meta:
        meta = self._remotes.get(agent)
        if meta is None:
            raise NotFoundError(f"remote agent {agent!r} is not loaded on {self._name!r}")
        return meta

    def register_memory(self, buffer: npt.NDArray[np.uint8]) -> MemoryHandle:
        """Register a contiguous, writeable, non-empty 1-D ``uint8`` array."""
        self._usable()
        check_buffer(buffer)
        handle = self._net._next_id()
        self._regions[handle] = Region(buffer, int(buffer.ctypes.data), int(buffer.size))
        return handle

    def deregister_memory(self, handle: MemoryHandle) -> None:
        """Deregister memory; transfers still touching it end ``"ERR"`` when they complete."""
        self._usable()
        if self._regions.pop(handle, None) is None:
            raise NotFoundError(f"unknown memory handle {handle} on agent {self._name!r}")

    def get_agent_metadata(self) -> bytes:
        """JSON snapshot: name, incarnation and the memory registered so far."""
        self._usable()
        regions = [(h, r.addr, r.length) for h, r in sorted(self._regions.items())]
        meta = Meta(META_KIND, self._net._id, self._name, self._gen, regions)
        return msgspec.json.encode(meta)

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load (or reload) a peer's metadata; returns its name. Malformed: `FabricError`."""
        self._usable()
        try:
            meta = msgspec.json.decode(metadata, type=Meta)
        except (msgspec.DecodeError, TypeError) as e:
            raise FabricError(f"malformed agent metadata: {e}") from e
        peer = self._net._incarnations.get(meta.gen)
        if meta.kind != META_KIND or meta.net != self._net._id or peer is None:
            raise FabricError("agent metadata is not from this SimNetwork")
        if peer.agent_name != meta.name:
            raise FabricError(f"agent metadata names {meta.name!r}, inconsistently")
        self._remotes[meta.name] = meta
        return meta.name

    def remove_remote_agent(self, agent: str) -> None:
        """Forget a peer, its prepared lists and its transfers (cancelling those in flight)."""
        self._usable()
        self._remote(agent)
        del self._remotes[agent]
        for h in [h for h, d in self._dlists.items() if d.peer == agent]:
            del self._dlists[h]
        for h in [h for h, x in self._xfers.items() if x.peer == agent]:
            self.release_xfer_handle(h)

    def prep_xfer_dlist(self, agent: str | None, descs: DescArray) -> DlistHandle:
        """Prepare rows of local (``agent=None``) or loaded remote memory.

        Every row must lie inside one registered region, with device id 0 (DRAM); remote rows
        are checked against the memory listed in the peer's loaded metadata.
        """
        self._usable()
        if agent is None:
            gen, owner = self._gen, f"{self._name!r}"
            regions = {h: (r.addr, r.length) for h, r in self._regions.items()}
        else:
            meta = self._remote(agent)
            gen, owner = meta.gen, f"{agent!r} (per its loaded metadata)"
            regions = {h: (a, n) for h, a, n in meta.regions}
        region, offset = resolve(descs, regions, owner)
        handle = self._net._next_id()
        self._dlists[handle] = Dlist(agent, gen, region, offset, descs[:, 1].copy())
        return handle

    def release_dlist_handle(self, handle: DlistHandle) -> None:
        """Release a prepared list; transfers made from it stay usable."""
        self._usable()
        if self._dlists.pop(handle, None) is None:
            raise NotFoundError(f"unknown dlist handle {handle} on agent {self._name!r}")

    def make_prepped_xfer(
        self,
        op: XferOp,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int64],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int64],
        notif: bytes,
    ) -> XferHandle:
        """Pair ``local[local_idx[i]]`` with ``remote[remote_idx[i]]``; lengths must match.
        Rows adjacent on both sides count as one, as NIXL's prepped path merges them."""
        self._usable()
        ld, rd = self._dlists.get(local), self._dlists.get(remote)
        if ld is None or rd is None:
            raise NotFoundError(f"unknown dlist handle {local if ld is None else remote}")
        if ld.peer is not None or rd.peer is None:
            raise FabricError("make_prepped_xfer needs a local dlist and a remote dlist")
        li = indices(local_idx, len(ld.region), "local_idx")
        ri = indices(remote_idx, len(rd.region), "remote_idx")
        if len(li) != len(ri):
            raise FabricError(f"local_idx has {len(li)} rows but remote_idx has {len(ri)}")
        return self._new_xfer(
            op,
            rd.peer,
            rd.gen,
            (ld.region[li], ld.offset[li], ld.length[li]),
            (rd.region[ri], rd.offset[ri], rd.length[ri]),
            notif,
            merge=True,
        )

    def make_xfer(
        self, op: XferOp, local: DescArray, agent: str, remote: DescArray, notif: bytes
    ) -> XferHandle:
        """Pair local row i with the loaded peer's row i, as `initialize_xfer` does: every row
        is checked against registered memory, and none are merged."""
        self._usable()
        meta = self._remote(agent)
        mine = {h: (r.addr, r.length) for h, r in self._regions.items()}
        lr, lo = resolve(local, mine, f"{self._name!r}")
        rr, ro = resolve(remote, {h: (a, n) for h, a, n in meta.regions}, f"{agent!r}")
        if len(lr) != len(rr):
            raise FabricError(f"{len(lr)} local rows cannot pair with {len(rr)} remote rows")
        return self._new_xfer(
            op,
            agent,
            meta.gen,
            (lr, lo, local[:, 1].copy()),
            (rr, ro, remote[:, 1].copy()),
            notif,
            merge=False,
        )

    def _new_xfer(
        self,
        op: XferOp,
        peer: str,
        gen: int,
        local: tuple[I64, I64, I64],
        remote: tuple[I64, I64, I64],
        notif: bytes,
        *,
        merge: bool,
    ) -> XferHandle:
        if op not in ("WRITE", "READ"):
            raise FabricError(f"unknown transfer op {op!r}")
        if not isinstance(notif, bytes):
            raise FabricError("notif must be bytes (b'' for none)")
        (lr, lo, length), (rr, ro, rlen) = local, remote
        bad = np.flatnonzero(length != rlen)
        if bad.size:
            i = int(bad[0])
            raise FabricError(
                f"pair {i}: the local row has {int(length[i])} bytes but the remote row has"
                f" {int(rlen[i])}"
            )
        merged = merged_rows(lr, lo, rr, ro, length) if merge else len(length)
        handle = self._net._next_id()
        self._xfers[handle] = Xfer(op, peer, gen, lr, lo, rr, ro, length, notif, merged)
        return handle

    def transfer(self, handle: XferHandle) -> XferState:
        """Post; ``"DONE"`` inside the call unless latency or a fault says otherwise."""
        self._usable()
        x = self._xfer(handle)
        if x.state == "PROC":
            raise RepostError(f"transfer {handle} is still in progress")
        if self._net._incarnations[x.gen]._refuses:
            raise RemoteDisconnectedError(f"remote agent {x.peer!r} disconnected")
        return self._net._post(self, handle, x)

    def check_xfer_state(self, handle: XferHandle) -> XferState:
        """Report a posted transfer (the clock, not this call, makes progress)."""
        self._usable()
        if handle in self._released_done:
            return "DONE"  # NIXL quirk: a released handle that had completed answers DONE
        x = self._xfer(handle)
        if x.state == "NEW":
            raise FabricError(f"transfer {handle} was never posted")
        if x.state != "ERR" and self._net._incarnations[x.gen]._refuses:
            raise RemoteDisconnectedError(f"remote agent {x.peer!r} disconnected")
        return x.state

    def release_xfer_handle(self, handle: XferHandle) -> None:
        """Release a transfer; one still in ``"PROC"`` is cancelled (no notification; no byte
        unless `SimFaults.late_delivery` says they still land)."""
        self._usable()
        x = self._xfer(handle)
        del self._xfers[handle]
        if x.state == "PROC":
            self._net._stats.xfers_cancelled += 1
            late = self._net.faults.late_delivery
            if late > 0:
                self._net._schedule(self._net.now + late, _LateBytes(self._gen, x))
        elif x.state == "DONE":
            self._released_done.add(handle)

    def xfer_telemetry(self, handle: XferHandle) -> XferTelemetry | None:
        """The simulated measurement of a finished transfer (virtual time; posting is free)."""
        self._usable()
        x = self._xfer(handle)
        if x.state != "DONE":
            return None
        return XferTelemetry(0.0, (x.done_at - x.posted_at) * 1e6, int(x.length.sum()), x.merged)

    def send_notif(self, agent: str, msg: bytes) -> None:
        """Send `msg` to a loaded peer; it arrives after `SimFaults.notif_latency`."""
        self._usable()
        meta = self._remote(agent)
        if not isinstance(msg, bytes):
            raise FabricError("notification must be bytes")
        target = self._net._incarnations[meta.gen]
        if target._refuses:
            raise RemoteDisconnectedError(f"remote agent {agent!r} disconnected")
        self._net._send(self, target, msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Drain the inbox: messages by sender, each list in arrival order."""
        self._usable()
        out: dict[str, list[bytes]] = {}
        for sender, msg in self._inbox:
            out.setdefault(sender, []).append(msg)
        self._inbox.clear()
        return out

    def close(self) -> None:
        """Release everything; peers see a reset connection. Idempotent, allowed when dead."""
        if self._down is None:
            self._net._take_down(self, "closed", silent=False)

    def in_flight(self) -> int:
        """Transfers posted and still ``"PROC"`` (not released)."""
        return sum(x.state == "PROC" for x in self._xfers.values())

    def open_resources(self) -> dict[str, int]:
        """Counts of what this agent holds; all zero after `close()`."""
        return {
            "memory": len(self._regions),
            "dlists": len(self._dlists),
            "xfers": len(self._xfers),
            "remote_agents": len(self._remotes),
            "in_flight": self.in_flight(),
        }

    def _clear(self) -> None:
        self._regions.clear()
        self._remotes.clear()
        self._dlists.clear()
        self._xfers.clear()
        self._released_done.clear()
        self._inbox.clear()


class SimNetwork(_FaultyClock):
    """Agents, a virtual clock (seconds, from 0) and seeded faults; see the module docstring.

    Clock, fault-injection and counter methods are inherited from `_FaultyClock`. `on_bytes`,
    if set, is called whenever a transfer's bytes land, at any latency: (agent written, ranges
    written, agent read, ranges read), host addresses [start, end); late bytes
    (`SimFaults.late_delivery`) were read before their release: no ranges read. The ledger's eyes.
    """

    def __init__(self, seed: int = 0, faults: SimFaults | None = None) -> None:
        super().__init__(seed, faults)
        self._id = next(_NETWORK_IDS)
        self._ids = itertools.count(1)  # handles are unique network-wide: misuse is NotFound
        self._live: dict[str, SimFabric] = {}
        self._incarnations: dict[int, SimFabric] = {}
        self.on_bytes: BytesObserver | None = None

    def agent_of(self, generation: int) -> str:
        """The agent name of a fabric generation (the `gen` pending events carry)."""
        return self._incarnations[generation].agent_name

    def agent(self, name: str) -> SimFabric:
        """Create an agent; `ValueError` if an agent of that name is alive."""
        if not isinstance(name, str) or not name:
            raise ValueError("agent name must be a non-empty string")
        if name in self._live:
            raise ValueError(f"agent {name!r} already exists")
        for old in self._incarnations.values():
            if old.agent_name == name:
                old._superseded = True  # connections to the old process now reset
        fabric = SimFabric(self, name, self._next_id())
        self._incarnations[fabric._gen] = fabric
        self._live[name] = fabric
        return fabric

    def revive(self, name: str) -> SimFabric:
        """A fresh agent (new memory, new metadata) for a dead or closed name.

        Peers must load its new metadata; what they prepared against the old incarnation
        raises `RemoteDisconnectedError` on use, as do transfers stuck on a silent death.
        """
        if name in self._live or not self._is_known(name):
            raise ValueError(f"no dead agent named {name!r} to revive")
        return self.agent(name)

    def kill(self, name: str, reset: bool) -> None:
        """Kill a live agent. ``reset=True``: peers' transfers to it end ``"ERR"`` and later
        operations towards it raise `RemoteDisconnectedError`. ``reset=False``: it becomes a
        black hole; transfers to it stay ``"PROC"``, notifications to or from it vanish."""
        fabric = self._live.get(name)
        if fabric is None:
            raise ValueError(f"no live agent named {name!r}")
        self._take_down(fabric, "dead", silent=not reset)

    def _is_live(self, name: str) -> bool:
        return name in self._live

    def _is_known(self, name: str) -> bool:
        return any(f.agent_name == name for f in self._incarnations.values())

    def _next_id(self) -> int:
        return next(self._ids)

    def _take_down(self, fabric: SimFabric, why: str, silent: bool) -> None:
        self._stats.xfers_cancelled += fabric.in_flight()
        fabric._clear()
        fabric._down, fabric._cut = why, silent
        del self._live[fabric.agent_name]
        if not silent:
            for other in self._live.values():
                for x in other._xfers.values():
                    if x.gen == fabric._gen and x.state == "PROC":
                        x.state = "ERR"
                        self._stats.xfers_err += 1

    def _post(self, fabric: SimFabric, handle: XferHandle, x: Xfer) -> XferState:
        latency, fail_rows = self._plan_post(fabric.agent_name, len(x.length))  # may raise
        x.state, x.post, x.posted_at = "PROC", x.post + 1, self._now
        if latency is None or self._incarnations[x.gen]._silent:
            return "PROC"  # no completion event: PROC until released
        if latency == 0:
            self._complete(fabric, x, fail_rows)
            return x.state
        self._schedule(self._now + latency, _Completion(fabric._gen, handle, x.post, fail_rows))
        return "PROC"

    def _on_completion(self, ev: _Completion) -> None:
        fabric = self._incarnations[ev.gen]
        x = fabric._xfers.get(ev.handle)  # gone if released (cancelled) or the agent is down
        if x is not None and x.post == ev.post and x.state == "PROC":
            self._complete(fabric, x, ev.fail_rows)

    def _complete(self, fabric: SimFabric, x: Xfer, fail_rows: int | None) -> None:
        target = self._incarnations[x.gen]
        if target._silent:
            return  # a black hole never answers
        rows = len(x.length) if fail_rows is None else fail_rows
        copied = not target._refuses and copy_rows(x, rows, fabric._regions, target._regions)
        if copied:
            self._landed(fabric, target, x, rows)
        if not copied or fail_rows is not None:
            x.state = "ERR"
            self._stats.xfers_err += 1
            return
        x.state, x.done_at = "DONE", self._now
        self._stats.xfers_done += 1
        self._stats.bytes_moved += int(x.length.sum())
        if x.notif:
            self._send(fabric, target, x.notif)  # scheduled with a positive latency

    def _land_late(self, event: _LateBytes) -> None:
        fabric, x = self._incarnations[event.gen], event.xfer
        target = self._incarnations[x.gen]
        live = fabric._down is None and target._down is None and not target._silent
        if live and copy_rows(x, len(x.length), fabric._regions, target._regions):
            self._stats.late_bytes += int(x.length.sum())
            self._landed(fabric, target, x, None)

    def _landed(self, initiator: SimFabric, target: SimFabric, x: Xfer, rows: int | None) -> None:
        into, out = (target, initiator) if x.op == "WRITE" else (initiator, target)
        if self.on_bytes is not None:  # late bytes (rows None) were read before their release
            read = [] if rows is None else written_ranges(x, out._regions, rows, read=True)
            self.on_bytes(into.agent_name, written_ranges(x, into._regions, rows), out._name, read)

    def late_writes_into(self, agent: str) -> list[tuple[int, int]]:
        """The byte ranges [start, end) (host addresses) of `agent`'s memory that bytes of
        released transfers are still due to write."""
        out = []
        for _, _, event in self._events:
            if isinstance(event, _LateBytes):
                x = event.xfer
                into = self._incarnations[x.gen if x.op == "WRITE" else event.gen]
                if into.agent_name == agent and into._down is None:
                    out += written_ranges(x, into._regions)
        return out

    def _send(self, sender: SimFabric, receiver: SimFabric, msg: bytes) -> None:
        notif = _Notif(sender.agent_name, sender._gen, receiver._gen, msg)
        self._send_notif(notif, receiver.agent_name, reachable=receiver._down is None)

    def _deliver(self, notif: _Notif) -> None:
        receiver = self._incarnations[notif.receiver_gen]
        if receiver._down is not None or self._incarnations[notif.sender_gen]._cut:
            self._stats.notifs_dropped += 1  # to a dead agent, or from behind a cut link
        elif receiver.agent_name in self._held:
            self._held[receiver.agent_name].append(notif)
        else:
            receiver._inbox.append((notif.sender, notif.msg))
            self._stats.notifs_delivered += 1
