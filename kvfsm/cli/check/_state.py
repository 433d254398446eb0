"""The state fingerprint of `kvfsm check`, and the peeks into the simulated network it needs.

Two explored states with the same fingerprint have the same futures, as far as the core can
tell: per engine its requests by key (random ids become `r1@P`, `r1@D`) with their state, flags,
tally and links, its deadlines, peers, transfers, handshakes, routes, tombstones and unmatched
registrations; the network's pending events in delivery order (messages decoded, block lists as
lengths) and who handshaked with whom; the ledger's books; faults used; aborts spent. Times are relative to now, and those
older than every bound are one value. Left out, as they steer nothing: random ids and blocks,
random generators, counters, and how a settled request (no engine holds it, no pending event
names it) ended. It reads the public snapshots of the cores, engines, simulated network,
directory and ledger (`snapshot()`), so a refactor of their private fields cannot change it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Any

import msgspec

from kvfsm.core import SideSnapshot
from kvfsm.fabric import FabricError
from kvfsm.runtime import StatusQuery
from kvfsm.sidechannel import DirectoryView
from kvfsm.sim import FAST_CONFIG, Cluster
from kvfsm.wire import WireError, decode

__all__ = [
    "Namer",
    "agent_of",
    "fingerprint",
    "flight_of",
    "handshakes",
    "is_late_bytes",
    "message_print",
    "pending_events",
    "questions",
    "state_print",
]

_HORIZON = max(v for v in msgspec.structs.asdict(FAST_CONFIG).values() if type(v) is float)
_PAST = -1e9  # any time longer ago than the longest bound


def pending_events(c: Cluster) -> list[tuple[float, int, Any]]:
    """The network's pending notifications and transfer completions, in delivery order."""
    return list(c.network.snapshot().events)


def is_late_bytes(ev: Any) -> bool:
    """Whether a pending event is the bytes of a released transfer landing late."""
    return hasattr(ev, "xfer")


def agent_of(c: Cluster, gen: int) -> str:
    return c.network.agent_of(gen)


def flight_of(c: Cluster, ev: Any) -> Any:
    """The live transfer a pending completion belongs to, if any."""
    agent = agent_of(c, ev.gen)
    flights = () if agent in c.dead else c.engines[agent].inflight.values()
    return next((f for f in flights if f.handle == ev.handle), None)


def handshakes(engine: Any) -> list[tuple[Any, ...]]:
    """The handshakes an engine's `DirectoryView` has under way: (due time, peer, ...)."""
    directory = engine.directory
    return directory.under_way() if isinstance(directory, DirectoryView) else []


def questions(engine: Any) -> list[tuple[float, StatusQuery]]:
    """The questions about transfers an engine's `DirectoryView` has under way: (due, it)."""
    directory = engine.directory
    return directory.asks_under_way() if isinstance(directory, DirectoryView) else []


class Namer:
    """Random request ids to stable names, times relative to now, and settled requests."""

    def __init__(self, c: Cluster) -> None:
        self.now = c.now
        self.ids = {pr.p_id: f"{k}@P" for k, pr in c.requests.items()}
        self.ids.update({pr.d_id: f"{k}@D" for k, pr in c.requests.items() if pr.d_id != pr.p_id})
        self.settled: frozenset[str] = frozenset()

    def id(self, text: str) -> str:
        """`text` with every request id replaced by its name."""
        for rid, name in self.ids.items():
            text = text.replace(rid, name)
        return text

    def keep(self, text: str) -> bool:
        """Whether `text` (ids named) mentions no settled request."""
        return not any(f"{key}@" in text for key in self.settled)

    def t(self, at: float | None) -> float | None:
        """`at` relative to now, rounded; times older than every bound collapse."""
        if at is None:
            return None
        return _PAST if at - self.now < -_HORIZON else round(at - self.now, 6)


def fingerprint(c: Cluster, faults: int, spent_actions: frozenset[tuple[str, ...]]) -> bytes:
    """The state of an explored cluster, as far as it steers what can happen next: a 16-byte
    digest of `state_print`, so that a search of millions of states keeps a digest each, not
    the whole print (a collision among 10^9 states has odds below 10^-20)."""
    text = repr(state_print(c, faults, spent_actions)).encode()
    return hashlib.blake2b(text, digest_size=16).digest()


def state_print(c: Cluster, faults: int, spent_actions: frozenset[tuple[str, ...]]) -> Hashable:
    """The readable fingerprint: strings, numbers and tuples only, each part in a canonical
    order, so that equal states have equal reprs in any process."""
    n = Namer(c)
    network = _network_print(c, n)
    held = [repr(network)]
    snaps = {a: e.side.snapshot() for a, e in c.engines.items() if a not in c.dead}  # once a state
    for a, snap in snaps.items():
        e = c.engines[a]
        held += [*e.side.requests, *(f.request_id for f in e.inflight.values())]
        held += [rid for _, rid, _ in snap.pending]
        held += [rid for _, rid, _ in e.side.quarantine]
    text = n.id(" ".join(held))
    n.settled = frozenset(k for k in c.requests if f"{k}@" not in text)
    engines = tuple(_engine_print(c, agent, n, snaps.get(agent)) for agent in sorted(c.engines))
    spent = tuple(sorted(a for a in spent_actions if n.keep(f"{a[1]}@")))
    return (engines, network, _ledger_print(c, n), faults, spent)


def _engine_print(c: Cluster, agent: str, n: Namer, snap: SideSnapshot | None) -> Hashable:
    if agent in c.dead or snap is None:
        return (agent, "dead")
    engine = c.engines[agent]
    side: Any = engine.side
    deadlines = sorted((n.id(k), event, n.t(at)) for k, event, at in snap.deadlines)
    peers = sorted(
        (
            p.id,
            p.state,
            len(p.outbox),
            tuple(map(n.id, p.waiters)),
            n.t(getattr(p, "idle_since", None)),
            round(getattr(p, "clock_offset", 0.0), 9),
            round(getattr(p, "clock_error", 0.0), 9),
            getattr(p, "incarnation", 0),
        )
        for p in side.peers.values()
    )
    flights = sorted(
        (n.id(f.request_id), f.op, f.peer, _xfer_state(engine, f.handle))
        for f in engine.inflight.values()
    )
    ended = [(n.id(k), v) for k, v in snap.tombstones if n.keep(n.id(k))]
    if side.side == "P":
        extra: Any = (
            sorted((s, n.id(r), n.t(expires)) for s, r, expires in snap.pending),
            sorted((n.id(k), n.id(v)) for k, v in snap.consumed if n.keep(n.id(k))),
            sorted(k for k in snap.ended_bases if n.keep(f"{k}@")),
        )
    else:
        holds = [(n.t(until), n.id(rid), len(blocks)) for until, rid, blocks in side.quarantine]
        extra = (n.t(snap.next_heartbeat), holds)
    return repr(
        (
            agent,
            snap.engine,
            sorted(_request_print(r, n) for r in side.requests.values()),
            deadlines,
            peers,
            flights,
            sorted((n.t(e[0]), e[1], e[-1]) for e in handshakes(engine)),
            [(n.t(at), q.agent, n.id(q.requester_request_id)) for at, q in questions(engine)],
            sorted(ended),
            list(engine.routes()),
            side.shut_down,
            extra,
            n.t(snap.next_peer_sweep),
        )
    )


def _xfer_state(engine: Any, handle: int) -> str:
    try:
        return str(engine.fabric.check_xfer_state(handle))
    except FabricError as exc:
        return type(exc).__name__


def _request_print(r: Any, n: Namer) -> tuple[Any, ...]:
    tally = r.tally
    links = [
        (
            a,
            n.id(link.request_id),
            bool(link.transfer_id),
            getattr(link, "granted", None),
            n.t(link.deadline),
            len(link.block_ids),
            link.incarnation,
        )
        for a, link in sorted(r.links.items())
    ]
    return (
        n.id(r.id),
        r.state,
        r.abort_requested,
        len(r.blocks),
        tally.state,
        tally.expected,
        tally.ok,
        tally.failed,
        sorted(tally.reported),
        links,
        sorted(r.acks),
        sorted(r.lost),
        r.consumer_released,
    )


def _network_print(c: Cluster, n: Namer) -> Hashable:
    events: list[Any] = []
    network = c.network.snapshot()  # once: it sorts the event heap
    ev: Any
    for when, _, ev in network.events:
        if is_late_bytes(ev):
            x = ev.xfer
            whose = message_print(x.notif, n) if x.notif else ()  # names the request
            events.append((n.t(when), "late", agent_of(c, ev.gen), x.op, len(x.length), whose))
        elif hasattr(ev, "msg"):
            receiver = agent_of(c, ev.receiver_gen)
            events.append((n.t(when), ev.sender, receiver, message_print(ev.msg, n)))
        else:
            flight = flight_of(c, ev)
            what = None if flight is None else n.id(flight.request_id)
            events.append((n.t(when), agent_of(c, ev.gen), what, ev.fail_rows is None))
    scripted = list(network.scripted_posts)
    failing = list(c.directory.snapshot().failing)
    guests = sorted(c.directory.guests.pairs())  # whose notifications each engine takes
    return repr((events, scripted, failing, sorted(c.dead), guests))


def message_print(payload: bytes, n: Namer) -> tuple[Any, ...]:
    """A message's kind and fields: ids as names, block lists as lengths, deadlines relative."""
    try:
        msg = decode(payload)
    except WireError:
        return ("malformed", "", "")
    fields = msgspec.structs.asdict(msg)
    return (type(msg).__name__, *(_field(k, v, n) for k, v in fields.items()))


def _field(name: str, value: Any, n: Namer) -> Any:
    if isinstance(value, str):
        return n.id(value)
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, list):
        return tuple(map(n.id, value))
    return n.t(value) if name == "deadline" else value


def _ledger_print(c: Cluster, n: Namer) -> Hashable:
    """The ledger's books of the requests not settled, and what settled ones still owe."""
    books = c.ledger.snapshot()
    live = {k for k in c.requests if k not in n.settled}
    return repr(
        (
            [
                (k, pr.finished_prefill, sorted(pr.final.items()))
                for k, pr in sorted(c.requests.items())
                if k in live
            ],
            sorted(n.settled),
            [x for x in books.released if x[0][1] in live],
            [x for x in books.received if x[1] in live],
            [x for x in books.failed if x[1] in live],
            [(k, list(v)) for k, v in books.owed if v or k in live],
            [x for x in books.freed if x[0] in live],
        )
    )


# --- the search ---------------------------------------------------------------------------------
