"""Hostile notifications injected into a running `Cluster`: random bytes, mutated encodings and
well-formed messages of every type with bogus ids, ranks, block ids and deadlines, from the real
peers, from the engines themselves and from agents nobody knows, at every point of a legitimate
request's life. The legitimate request must end `done` on both sides with its bytes verified and
the same transitions as without the noise; the safety ledger and conformance must stay clean;
every bogus input is counted (under some counter: which one may change, e.g. when notifications
from agents that never handshaked are dropped before decoding) and leaves nothing behind."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.core import MAX_PEERS, Admit, Identity, NotificationReceived, Producer, Tick
from kvfsm.fabric import SimFaults
from kvfsm.runtime import Engine
from kvfsm.sim import FAST_CONFIG, Cluster
from kvfsm.wire import (
    Cancel,
    Heartbeat,
    Registration,
    WireError,
    base_request_id,
    decode,
    encode,
)
from tests.fuzz.strategies import mutated_bytes, texts, wire_messages

KEY = "legit"  # the legitimate request; its ids are KEY-<8 hex>
BLOCKS = 3
STEPS = 12  # 1 ms steps: the legitimate request runs for about 10 of them (see FAULTS)
FAULTS = SimFaults(transfer_latency=0.005)  # transfers take 5 ms: injections land mid-write
QUIET_S = 2 * (FAST_CONFIG.pending_registration_ttl_s + FAST_CONFIG.peer_idle_ttl_s)
"""Simulated time after which everything a bogus input could have started has expired."""

# Ids that can never name the legitimate request: P matches a registration by its base id too.
bogus_ids = texts.filter(lambda s: base_request_id(s) != KEY)
# The real peers (so payloads get past any check of the sender, decoded and routed), the
# engines themselves, and strangers.
senders = st.one_of(
    st.sampled_from(["P#0", "D#0"]), st.sampled_from(["stranger#0", "P#1", "D#1", "", "#"]), texts
)
payloads = st.one_of(
    wire_messages(bogus_ids).map(encode),
    wire_messages(bogus_ids).map(encode),  # three times: most shots decode
    wire_messages(bogus_ids).map(encode),
    wire_messages(bogus_ids).map(encode).flatmap(mutated_bytes),
    st.binary(max_size=64),
    st.binary(max_size=64).map(lambda b: b"kv1" + b),
)


@dataclass(frozen=True)
class Injection:
    """One bogus notification: when (step), to whom, claiming to be from whom."""

    step: int
    target: str
    sender: str
    payload: bytes


injections = st.builds(
    Injection,
    step=st.integers(-1, STEPS),  # -1: before the request is admitted
    target=st.sampled_from(["P#0", "D#0"]),
    sender=senders,
    payload=payloads,
)


def _errors(engine: Engine) -> int:
    """Everything an engine and its core have counted (both count only what the caller and the
    network did; an injection runs synchronously, so a change is the injection's doing)."""
    return engine.side.counters.total() + engine.counters.total()


def _decoded(payload: bytes) -> object:
    try:
        return decode(payload)
    except WireError:
        return None


def _held_registration(target: str, payload: bytes) -> bool:
    """A bogus registration P holds without counting it at once: one for a request it does not
    know yet (it cannot tell it from a registration that overtook the admission); it expires
    after `pending_registration_ttl_s`, counted then."""
    return target == "P#0" and isinstance(_decoded(payload), Registration)


def _noop(payload: bytes) -> bool:
    """A heartbeat naming no request: nothing to count, nothing to do."""
    message = _decoded(payload)
    return isinstance(message, Heartbeat) and not message.request_ids


def _connects_p(mode: str, shot: Injection) -> bool:
    """A cancel from the real D for a request P does not know: a push P acknowledges it (D may be
    fencing a registration that never arrived), which connects P to D before the legitimate
    registration does."""
    cancel = isinstance(_decoded(shot.payload), Cancel)
    return mode == "push" and cancel and (shot.target, shot.sender) == ("P#0", "D#0")


def _connected_first(history: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """P's history had it been connected to D when the registration came: no wait in `matched`."""
    waited = [("registration", "matched"), ("peer_connected", "writing")]
    for i in range(len(history) - 1):
        if history[i : i + 2] == waited:
            return [*history[:i], ("registration", "writing"), *history[i + 2 :]]
    return history


def _inject(cluster: Cluster, shot: Injection) -> bool:
    """Hand one injection to the core of its target (as `Cluster.inject_garbage` does) and
    check it was counted at once, or held; True if P holds it as an unmatched registration."""
    engine = cluster.engines[shot.target]
    before = _errors(engine)
    engine.submit(NotificationReceived(shot.sender, shot.payload))  # must never raise
    cluster.collect()
    counted = _errors(engine) > before
    held = _held_registration(shot.target, shot.payload)
    assert counted or held or _noop(shot.payload), f"{shot} was neither counted nor held"
    return held and not counted


class Forged:
    """Notifications that arrive at an engine's next poll as if `sender` had sent them (NIXL
    names a notification's sender as that agent claims): they take the engine's whole inbound
    path, where checks before the core (authentication, strangers) apply."""

    def __init__(self, engine: Engine) -> None:
        self._queue: list[tuple[str, bytes]] = []
        self._drain = engine.fabric.get_new_notifs
        engine.fabric.get_new_notifs = self._notifs  # type: ignore[method-assign]

    def add(self, sender: str, payload: bytes) -> None:
        """Deliver `payload` from `sender` at the next poll."""
        self._queue.append((sender, payload))

    def _notifs(self) -> dict[str, list[bytes]]:
        out = self._drain()
        for sender, payload in self._queue:
            out.setdefault(sender, []).append(payload)
        self._queue.clear()
        return out


def _transitions(history: tuple[tuple[str, str, float], ...]) -> list[tuple[str, str]]:
    return [(event, state) for event, state, _ in history]


class Run:
    """The legitimate request with `shots` delivered at their steps, `via` the core (checked
    one by one) or the fabric (the engine's inbound path); then time runs until anything the
    noise started has expired. `histories`: each engine's transitions of the request."""

    def __init__(self, mode: str, shots: list[Injection], via: str) -> None:
        self.cluster = cluster = Cluster(mode, seed=7, faults=FAULTS)  # type: ignore[arg-type]
        self.via = via
        self.forged = {agent: Forged(engine) for agent, engine in cluster.engines.items()}
        self.histories: dict[str, list[tuple[str, str]]] = {}
        cluster.on_finished = lambda agent, out: self.histories.__setitem__(
            agent, _transitions(out.history)
        )
        self.held = 0
        by_step: dict[int, list[Injection]] = {}
        for shot in shots:
            by_step.setdefault(shot.step, []).append(shot)
        self._deliver(by_step.get(-1, []))
        cluster.step(1e-3)
        pr = cluster.admit(KEY, BLOCKS)
        cluster.finish_prefill(KEY)
        for step in range(STEPS + 1):
            self._deliver(by_step.get(step, []))
            cluster.step(1e-3)
        cluster.settle()
        assert pr.final == {"P#0": "done", "D#0": "done"}, pr.final
        for _ in range(4):
            cluster.step(QUIET_S / 4)

    def _deliver(self, shots: list[Injection]) -> None:
        for shot in shots:
            if self.via == "core":
                self.held += _inject(self.cluster, shot)
            else:
                self.forged[shot.target].add(shot.sender, shot.payload)

    def errors(self) -> int:
        """Everything every engine counted."""
        return sum(_errors(engine) for engine in self.cluster.engines.values())


_BASELINE: dict[str, Run] = {}


def _baseline(mode: str) -> Run:
    if mode not in _BASELINE:
        _BASELINE[mode] = Run(mode, [], "core")
    return _BASELINE[mode]


def _check_clean(cluster: Cluster) -> None:
    assert cluster.ledger.quiescence() == []
    assert cluster.conformance is not None and cluster.conformance.violations == []
    # Every byte of the legitimate request was compared on D (property 4 of the ledger).
    d = cluster.geometry["D"]
    assert cluster.ledger.verified_bytes == BLOCKS * d.block_len * d.num_regions
    for engine in cluster.live_engines():
        assert len(engine.side.errors) <= (engine.side.errors.maxlen or 0)
        # Nothing left: no deadline, no pending registration, no peer sweep (peers idle out).
        assert engine.next_wakeup() is None, engine.agent


@pytest.mark.parametrize("via", ["core", "fabric"])
@pytest.mark.parametrize("mode", ["push", "pull"])
@settings(max_examples=150)
@given(shots=st.lists(injections, max_size=8))
def test_noise_does_not_touch_a_running_request(
    mode: str, via: str, shots: list[Injection]
) -> None:
    run = Run(mode, shots, via)
    _check_clean(run.cluster)
    # No effect on the request: the very same transitions as without the noise, but for P
    # finding D connected already where a cancel made P acknowledge D first.
    expected = [_baseline(mode).histories]
    if any(_connects_p(mode, s) for s in shots):
        baseline = _baseline(mode).histories
        expected.append({**baseline, "P#0": _connected_first(baseline["P#0"])})
    assert run.histories in expected
    p_counters = run.cluster.engines["P#0"].side.counters
    if run.held:  # held registrations are dropped in the end, and counted then
        assert p_counters["registration_expired"] + p_counters["registration_withdrawn"] > 0
    # Counted: the same request ran as in the baseline, so what the engines counted beyond
    # the baseline is the noise's; each shot that is not a registration for P (which P may
    # hold) nor a no-op counts at least once, wherever (core, or the engine's own checks).
    surely_counted = [
        s for s in shots if not (_held_registration(s.target, s.payload) or _noop(s.payload))
    ]
    assert run.errors() - _baseline(mode).errors() >= len(surely_counted)


def _flood(cluster: Cluster, n: int) -> Counter[str]:
    """`n` bogus notifications of every kind from the real peers and one stranger, spread over
    both engines; returns how many went where."""
    sent: Counter[str] = Counter()
    for i in range(n):
        target, peer = ("P#0", "D#0") if i % 2 else ("D#0", "P#0")
        sender = "stranger#0" if i % 7 == 0 else peer
        kind = i % 4
        if kind == 0:
            payload = b"kv1\x91" + i.to_bytes(4, "little")
        elif kind == 1:
            payload = encode(Cancel(request_id="", sender_request_id=f"f{i}", rank=0, tp_size=1))
        elif kind == 2:
            payload = encode(
                Registration(
                    request_id="",
                    sender_request_id=f"f{i}",
                    rank=0,
                    tp_size=1,
                    engine_id="D",
                    block_ids=b"\x01\x00\x00\x00",
                    deadline=1e9,
                )
            )
        else:
            payload = encode(Heartbeat(request_ids=[f"f{i}", f"g{i}"], rank=0))
        cluster.engines[target].submit(NotificationReceived(sender, payload))
        sent[target] += 1
    cluster.collect()
    return sent


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_flood_is_counted_and_bounded(mode: str) -> None:
    """20,000 bogus notifications while a request runs: it still succeeds; the error log keeps
    its bound; unmatched registrations stay within `max_pending_registrations` (beyond it P
    refuses, counted) and expire; no peer is created for the noise."""
    config = msgspec.structs.replace(FAST_CONFIG, max_pending_registrations=64)
    cluster = Cluster(mode, seed=11, faults=FAULTS, config=config)  # type: ignore[arg-type]
    pr = cluster.admit(KEY, BLOCKS)
    cluster.finish_prefill(KEY)
    cluster.step(2e-3)  # the request is under way (handshakes done, transfer posted)
    before = {agent: _errors(engine) for agent, engine in cluster.engines.items()}
    sent = _flood(cluster, 20_000)
    cluster.settle()
    assert pr.final == {"P#0": "done", "D#0": "done"}
    for _ in range(4):
        cluster.step(QUIET_S / 4)
    for agent, engine in cluster.engines.items():
        # Each injection counted at least once (replies to the noise count on the other side).
        assert _errors(engine) - before[agent] >= sent[agent], (agent, engine.side.counters)
        assert set(engine.side.peers) <= {"P#0", "D#0", "stranger#0"}
    assert cluster.engines["P#0"].side.counters["registration_expired"] <= 64
    _check_clean(cluster)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_cancels_from_many_senders_keep_the_core_s_peers_bounded(mode: str) -> None:
    cluster = Cluster(mode, seed=1)  # type: ignore[arg-type]
    p = cluster.engines["P#0"]
    # Straight into the core: agents that did handshake (or a deployment without guests) can
    # still name ever new senders; the core's peers stay bounded and P keeps serving.
    for i in range(MAX_PEERS + 500):
        cancel = Cancel(
            request_id="", sender_request_id=f"x{i}", rank=0, tp_size=1, contact="10.0.0.1:1"
        )
        p.submit(NotificationReceived(f"evil{i}#0", encode(cancel)))
        cluster.step(0.01)  # its handshake (to nowhere) fails: the peer is inert from then
    cluster.settle()
    assert len(p.side.peers) <= MAX_PEERS, f"P holds {len(p.side.peers)} peers"
    assert p.side.counters["peers_forgotten"] >= 500
    assert cluster.serve("after", 2) == {"P#0": "done", "D#0": "done"}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_cancels_from_many_strangers_through_the_fabric_are_dropped(mode: str) -> None:
    # The same flood on the engine's inbound path: agents that never handshaked are dropped
    # before the core (counted), so the core creates no peer for them.
    cluster = Cluster(mode, seed=1)  # type: ignore[arg-type]
    p = cluster.engines["P#0"]
    forged = Forged(p)
    for i in range(1000):
        cancel = Cancel(
            request_id="", sender_request_id=f"x{i}", rank=0, tp_size=1, contact="10.0.0.1:1"
        )
        forged.add(f"evil{i}#0", encode(cancel))
    before = _errors(p)
    cluster.step(1e-3)
    assert _errors(p) - before >= 1000
    assert p.side.peers == {}


def _suffixless_registration() -> bytes:
    # D names no P id (push, P's id unknown to D) and its own id has no -<8 hex> suffix.
    return encode(
        Registration(
            request_id="",
            sender_request_id="req",
            rank=0,
            tp_size=1,
            engine_id="D",
            block_ids=b"\x00\x00\x00\x00",
            deadline=1e9,
        )
    )


def test_pending_registration_without_suffix_expires() -> None:
    p = Producer(Identity("P", 0, 1), "push", FAST_CONFIG)
    p.handle(NotificationReceived("D#0", _suffixless_registration()), 0.0)
    p.handle(Tick(), 10.0)  # past pending_registration_ttl_s (this once raised KeyError)
    assert p.counters["registration_expired"] == 1


def test_pending_registration_without_suffix_is_matched_on_admission() -> None:
    p = Producer(Identity("P", 0, 1), "push", FAST_CONFIG)
    p.handle(NotificationReceived("D#0", _suffixless_registration()), 0.0)
    p.handle(Admit("req", np.array([1], dtype=np.int32)), 0.1)  # (this once raised KeyError)
    assert p.requests["req"].peers == ("D#0",)
