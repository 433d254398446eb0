"""A rank restarted under the same agent name must not be written with what its previous process
registered.

Known bug, found on 2026-11-27 by the ledger's byte-level check (it sees every landing, also
inside a post): in push, P matches a registration from D's old process, connects to the new one
(its handshake began before the restart and answers after it) and WRITEs the old registration's
blocks into the new process's memory, where no request holds them. Fixing it needs the sender's
incarnation in registrations and grants and in the handshake, checked before a post. Where
vLLM gives every engine start a fresh engine id, agent names never repeat and this cannot
happen; with a fixed `engine_id` it can."""

from __future__ import annotations

import pytest

from kvfsm.testing import Cluster


@pytest.mark.xfail(strict=True, reason="a revived D is written with its old registration")
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
