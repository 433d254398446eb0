"""Who an engine takes notifications from, on the simulated fabric: peers that completed a
handshake (either way), and with a shared secret only what a holder of it sealed for exactly this
sender and receiver. Everything else is counted and dropped, and the request it aimed at is served
as if it had never come."""

from __future__ import annotations

import pytest

from kvfsm.core import Mode
from kvfsm.runtime import Guests
from kvfsm.sim import Cluster
from kvfsm.wire import AuthError, Registration, ReplayGuard, SharedSecret, encode, pack_blocks

MODES: tuple[Mode, ...] = ("push", "pull")
SECRET = SharedSecret(b"0123456789abcdef-kvfsm-tests")


def _registration(pr_p_id: str, blocks: list[int]) -> bytes:
    return encode(Registration(pr_p_id, "forged-00000000", 0, 1, "X", pack_blocks(blocks), 1e9, ""))


def _blocks_untouched(c: Cluster, key: str) -> None:
    assert c.ledger.violations == [] and c.ledger.quiescence() == []
    assert set(c.requests[key].final.values()) == {"done"}


@pytest.mark.parametrize("mode", MODES)
def test_a_stranger_with_ps_metadata_is_not_heard(mode: Mode) -> None:
    c = Cluster(mode)
    pr = c.admit("r", 2)
    # An agent that got P's metadata without a handshake (NIXL would deliver its notifications)
    # registers other blocks for P's request, first: P must not match it.
    stranger = c.network.agent("X#0")
    stranger.add_remote_agent(c.engines["P#0"].fabric.get_agent_metadata())
    stranger.send_notif("P#0", _registration(pr.p_id, [0]))
    c.finish_prefill("r")
    c.settle()
    _blocks_untouched(c, "r")
    p = c.engines["P#0"]
    assert p.counters["stranger"] == 1
    assert not any(k in p.side.counters for k in ("duplicate", "protocol_error", "rejected"))


@pytest.mark.parametrize("mode", MODES)
def test_with_a_secret_requests_are_served_and_unsealed_words_are_dropped(mode: Mode) -> None:
    c = Cluster(mode, secret=SECRET)
    assert c.serve("warm", 2) == {"P#0": "done", "D#0": "done"}
    pr = c.admit("r", 2)
    d = c.engines["D#0"].fabric  # a peer P knows, but this message is not sealed ...
    d.send_notif("P#0", _registration(pr.p_id, [0]))
    # ... and this one is sealed by a holder of another secret.
    other = SharedSecret(b"another-secret-of-16-bytes")
    d.send_notif("P#0", other.seal("D#0", "P#0", _registration(pr.p_id, [1])))
    c.finish_prefill("r")
    c.settle()
    _blocks_untouched(c, "r")
    assert c.engines["P#0"].counters["unauthenticated"] == 2
    assert c.engines["D#0"].counters["unauthenticated"] == 0


def test_an_engine_without_the_secret_drops_sealed_notifications() -> None:
    c = Cluster("push")
    assert c.serve("warm", 2) == {"P#0": "done", "D#0": "done"}
    pr = c.admit("r", 2)
    sealed = SECRET.seal("D#0", "P#0", _registration(pr.p_id, [0]))
    c.engines["D#0"].fabric.send_notif("P#0", sealed)
    c.finish_prefill("r")
    c.settle()
    _blocks_untouched(c, "r")
    assert c.engines["P#0"].counters["unauthenticated"] == 1


def test_a_seal_binds_sender_receiver_and_bytes() -> None:
    payload = b"kv1-anything"
    sealed = SECRET.seal("D#0", "P#0", payload)
    assert SECRET.open("D#0", "P#0", sealed).payload == payload
    for sender, receiver, data in [
        ("D#1", "P#0", sealed),  # moved to another sender
        ("D#0", "P#1", sealed),  # or receiver
        ("D#0", "P#0", sealed[:-1] + b"!"),  # altered
        ("D#0", "P#0", payload),  # not sealed
        ("D#0", "P#0", SECRET.seal("D#0", "P#0", payload, 7, 1)[:20] + sealed[20:]),  # renumbered
    ]:
        with pytest.raises(AuthError):
            SECRET.open(sender, receiver, data)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SharedSecret("short")
    assert "0123" not in repr(SECRET)


def test_guests_are_bounded_least_recently_admitted_first() -> None:
    guests = Guests(limit=2)
    guests.admit("P#0", "D#0")
    guests.admit("P#0", "D#1")
    guests.admit("P#0", "D#0")  # admitted again: now the most recent
    guests.admit("P#0", "D#2")
    assert [guests.admitted("P#0", d) for d in ("D#0", "D#1", "D#2")] == [True, False, True]
    assert len(guests) == 2 and not guests.admitted("P#1", "D#0")


@pytest.mark.parametrize("mode", MODES)
def test_a_replayed_notification_is_refused_and_counted(mode: Mode) -> None:
    """A notification recorded on the wire and sent again (or duplicated by the network) is
    refused by its number, with the secret set; the requests go on."""
    c = Cluster(mode, secret=SECRET)
    d = c.engines["D#0"].fabric
    recorded: list[tuple[str, bytes]] = []
    send = d.send_notif

    def recording(agent: str, msg: bytes) -> None:
        recorded.append((agent, msg))
        send(agent, msg)

    d.send_notif = recording  # type: ignore[method-assign]
    assert c.serve("warm", 2) == {"P#0": "done", "D#0": "done"}
    assert recorded and c.engines["P#0"].counters["replayed"] == 0
    replayed = list(recorded)
    for agent, msg in replayed:  # the whole conversation, replayed
        send(agent, msg)
    c.network.duplicate_next_notif("P#0")  # and the network duplicating the next one
    assert c.serve("next", 2) == {"P#0": "done", "D#0": "done"}
    p = c.engines["P#0"]
    assert p.counters["replayed"] == len(replayed) + 1
    assert not any(k in p.side.counters for k in ("duplicate", "late", "protocol_error"))


def test_the_replay_guard_takes_each_number_once_and_follows_restarts() -> None:
    guard = ReplayGuard(limit=2)
    assert [guard.check("D#0", 5, n) for n in (1, 3, 2)] == [None] * 3  # reordered: taken
    assert "taken before" in str(guard.check("D#0", 5, 2))
    assert guard.check("D#0", 5, 1000) is None
    assert guard.check("D#0", 5, 4) is None  # 996 numbers behind the newest: still taken once
    assert "taken before" in str(guard.check("D#0", 5, 4))
    assert "never sent" in str(guard.check("D#0", 5, 0))
    assert guard.check("D#0", 6, 1) is None  # a restarted sender: a later epoch starts afresh
    assert "earlier incarnation" in str(guard.check("D#0", 5, 99))
    assert guard.check("D#1", 1, 1) is None and guard.check("D#2", 1, 1) is None
    assert guard.check("D#0", 6, 1) is None  # D#0 was forgotten (bounded): it starts afresh


def test_the_replay_guard_waits_for_a_number_until_its_ttl_or_its_bound() -> None:
    """A gap is waited for `gap_ttl_s` after a later number opened it, and the oldest gaps go
    first past `max_gaps`: memory stays bounded, and what went is refused, never taken twice."""
    guard = ReplayGuard(max_gaps=4, gap_ttl_s=10.0)
    assert guard.check("P#0", 1, 3, now=0.0) is None and guard.gaps == 2  # 1 and 2 awaited
    assert guard.check("P#0", 1, 1, now=9.9) is None  # within the TTL: taken
    assert "waited for too long" in str(guard.check("P#0", 1, 2, now=10.0))
    assert guard.gaps == 0
    assert guard.check("P#0", 1, 10, now=11.0) is None and guard.gaps == 4  # 6..9: 4 to 9 cut
    assert [guard.check("P#0", 1, n, now=11.0) is None for n in (5, 6, 9)] == [False, True, True]
    assert guard.gaps == 2
