"""Where to handshake: P's side channel travels to D in the Admit (from P's transfer params), D's
travels to P in D's registration, and each handshake the core starts names it."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.core import (
    Admit,
    Consumer,
    HandshakeDone,
    Identity,
    Mode,
    NotificationReceived,
    PrefillFinished,
    Producer,
    SendNotification,
    StartHandshake,
)
from kvfsm.wire import Registration, decode

_BLOCKS = np.array([1, 2], dtype=np.int32)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_each_side_handshakes_where_the_other_said_it_listens(mode: Mode) -> None:
    p = Producer(Identity("prefill", contact="10.0.0.1:5650"), mode)
    d = Consumer(Identity("decode", contact="10.0.0.2:5660"), mode)
    p.handle(Admit("r-0000000a", _BLOCKS), 0.0)
    p.handle(PrefillFinished("r-0000000a", _BLOCKS), 0.0)
    out = d.handle(Admit("r-0000000b", _BLOCKS, "prefill", 1, "r-0000000a", "10.0.0.1:5650"), 0.0)
    assert StartHandshake("prefill#0", "10.0.0.1:5650") in out
    out = d.handle(HandshakeDone("prefill#0"), 0.0)
    (reg,) = [decode(c.payload) for c in out if isinstance(c, SendNotification)]
    assert isinstance(reg, Registration) and reg.contact == "10.0.0.2:5660"
    out = p.handle(NotificationReceived("decode#0", out[0].payload), 0.0)  # type: ignore[union-attr]
    assert StartHandshake("decode#0", "10.0.0.2:5660") in out


def test_an_admit_without_a_contact_leaves_it_to_the_directory() -> None:
    d = Consumer(Identity("decode"), "push")
    out = d.handle(Admit("r-0000000b", _BLOCKS, "prefill", 2, "r-0000000a"), 0.0)
    # D's one rank gathers from both of P's: two handshakes, each address left to the directory.
    starts = {c for c in out if isinstance(c, StartHandshake)}
    assert starts == {StartHandshake("prefill#0", ""), StartHandshake("prefill#1", "")}
