"""A rank restarted under the same agent name is never written or read with block ids its
previous process sent: registrations, grants and handshakes name the sender's incarnation,
and a transfer is posted only when the message's and the connection's agree.

Found by the ledger's byte-level check: P matched a registration from D's old process,
connected to the new one and WROTE the old registration's blocks into the new process's
memory, where no request held them."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.core import (
    Admit,
    Command,
    Consumer,
    Finished,
    HandshakeDone,
    Identity,
    Mode,
    NotificationReceived,
    PostTransfer,
    PrefillFinished,
    Producer,
    RemoveAgent,
    ReportFailed,
    SendNotification,
    StartHandshake,
)
from kvfsm.sim import Cluster
from kvfsm.wire import Failure, Grant, Registration, decode, encode, pack_blocks


def test_p_does_not_write_into_a_restarted_d_with_its_old_registration() -> None:
    c = Cluster("push", p_tp=2, d_tp=1, num_blocks=24)
    c.admit("r1", 0)
    c.step(0.001)
    c.admit("r2", 1)
    c.kill("D#0", reset=True)  # its registration of r2 is already on its way to P
    c.revive("D#0")
    for key in sorted(c.requests):
        c.finish_prefill(key)
    c.settle()
    assert c.ledger.violations == []
    stale = sum(c.engines[p].side.counters["stale_incarnation"] for p in ("P#0", "P#1"))
    assert stale >= 1  # the check, not luck, kept the old registration's bytes out


# --- the core's checks, event by event --------------------------------------------------------

_BLOCKS = np.array([1, 2], dtype=np.int32)
_P_ID, _D_ID = "r-0000000a", "r-0000000b"


def _registration(incarnation: int, d_id: str = _D_ID) -> NotificationReceived:
    reg = Registration(
        _P_ID if d_id == _D_ID else "r-0000000c",
        d_id,
        0,
        1,
        "decode",
        pack_blocks(_BLOCKS),
        30.0,
        incarnation=incarnation,
    )
    return NotificationReceived("decode#0", encode(reg))


def _producer(mode: Mode, *request_ids: str) -> Producer:
    p = Producer(Identity("prefill"), mode)
    p.incarnation = 9
    for rid in request_ids or (_P_ID,):
        p.handle(Admit(rid, _BLOCKS), 0.0)
        p.handle(PrefillFinished(rid, _BLOCKS), 0.0)
    return p


def _sent(out: list[Command]) -> list[object]:
    return [decode(c.payload) for c in out if isinstance(c, SendNotification)]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("registered", "answered"), [(1, 2), (2, 1)])
def test_p_moves_kv_only_for_the_d_process_its_handshake_reached(
    mode: Mode, registered: int, answered: int
) -> None:
    p = _producer(mode)
    p.handle(_registration(registered), 0.0)
    out = p.handle(HandshakeDone("decode#0", incarnation=answered), 0.0)
    assert not [c for c in out if isinstance(c, PostTransfer)]
    assert not [m for m in _sent(out) if isinstance(m, Grant)]
    assert p.counters["stale_incarnation"] == 1
    assert [type(m) for m in _sent(out)] == [Failure]  # D's rank, if it listens, stops waiting
    assert [c.state for c in out if isinstance(c, Finished)] == ["failed"]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_p_moves_kv_when_the_incarnations_agree(mode: Mode) -> None:
    p = _producer(mode)
    p.handle(_registration(3), 0.0)
    out = p.handle(HandshakeDone("decode#0", incarnation=3), 0.0)
    if mode == "push":
        assert [c.op for c in out if isinstance(c, PostTransfer)] == ["WRITE"]
    else:
        (grant,) = [m for m in _sent(out) if isinstance(m, Grant)]
        assert grant.incarnation == 9  # D checks P's process in turn
    assert p.counters["stale_incarnation"] == 0


def test_d_reads_only_from_the_p_process_its_handshake_reached() -> None:
    d = Consumer(Identity("decode"), "pull")
    d.incarnation = 4
    d.handle(Admit(_D_ID, _BLOCKS, "prefill", 1, _P_ID), 0.0)
    out = d.handle(HandshakeDone("prefill#0", incarnation=6), 0.0)
    (reg,) = _sent(out)
    assert isinstance(reg, Registration) and reg.incarnation == 4
    grant = Grant(_D_ID, _P_ID, 0, 1, pack_blocks(_BLOCKS), 20.0, incarnation=5)  # P's old one
    out = d.handle(NotificationReceived("prefill#0", encode(grant)), 0.0)
    assert not [c for c in out if isinstance(c, PostTransfer)]
    assert [c.request_id for c in out if isinstance(c, ReportFailed)] == [_D_ID]
    assert d.counters["stale_incarnation"] == 1


def test_a_registration_from_a_restarted_d_replaces_the_old_connection() -> None:
    p = _producer("push", _P_ID, "r-0000000c")
    p.handle(_registration(1), 0.0)
    p.handle(HandshakeDone("decode#0", incarnation=1), 0.0)
    # D restarted under its name; its new process registers the second request.
    out = p.handle(_registration(2, d_id="r-0000000d"), 0.0)
    assert RemoveAgent("decode#0") in out and StartHandshake("decode#0") in out
    assert p.counters["peer_restarted"] == 1
    out = p.handle(HandshakeDone("decode#0", incarnation=2), 0.0)
    (write,) = [c for c in out if isinstance(c, PostTransfer)]
    assert write.request_id == "r-0000000c" and write.peer == "decode#0"
