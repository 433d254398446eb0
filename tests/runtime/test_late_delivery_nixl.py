"""The real fabric bounds how long a given-up transfer's bytes may land (UCX over TCP), and D's
engine holds given-up blocks at least that long (tests/runtime/test_late_delivery.py has the hold
itself; tests/harness/test_two_hosts.py cuts a real link under a transfer)."""

from __future__ import annotations

import os

import msgspec
import pytest

from kvfsm.core import Consumer, Identity
from kvfsm.fabric import TCP_DRAIN_SLACK_S, TCP_USER_TIMEOUT_DEFAULT, NixlFabric
from kvfsm.runtime import Engine, KvCache
from kvfsm.sidechannel import LocalDirectory
from kvfsm.sim import FAST_CONFIG, SMALL_GEOMETRY

pytestmark = pytest.mark.nixl


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> NixlFabric:
    monkeypatch.delenv("UCX_TCP_USER_TIMEOUT", raising=False)  # restored after the test
    monkeypatch.delenv("UCX_TLS", raising=False)
    return NixlFabric("D#0")


def test_nixl_fabric_sets_a_tcp_user_timeout_and_reports_its_bound(fabric: NixlFabric) -> None:
    try:
        assert os.environ["UCX_TCP_USER_TIMEOUT"] == TCP_USER_TIMEOUT_DEFAULT == "10s"
        assert fabric.late_delivery_s == 10.0 + TCP_DRAIN_SLACK_S
    finally:
        fabric.close()


def test_an_engine_on_nixl_holds_given_up_blocks_at_least_that_long(fabric: NixlFabric) -> None:
    kv = KvCache.allocate(SMALL_GEOMETRY)
    short = msgspec.structs.replace(FAST_CONFIG, transport_drain_s=1.0)
    try:
        with pytest.raises(ValueError, match=r"below the 12\.0 s"):
            Engine(
                Consumer(Identity("D"), "push", short),
                fabric,
                kv,
                LocalDirectory().view(),
                lambda: 0.0,
            )
        engine = Engine(
            Consumer(Identity("D"), "push", FAST_CONFIG),
            fabric,
            kv,
            LocalDirectory().view(),
            lambda: 0.0,
        )
        assert engine.side.transport_drain_s == fabric.late_delivery_s
        engine.close()
    finally:
        fabric.close()
