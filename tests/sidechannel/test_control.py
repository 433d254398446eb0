"""Operator requests on the side-channel listener (`kvfsm drain HOST:PORT`): a drain reaches
the hook, a status is answered, and without the deployment's secret nothing is drained."""

from __future__ import annotations

import pytest

from kvfsm.cli import main
from kvfsm.sidechannel import ControlRequest, HandshakeListener, request_control
from kvfsm.wire import SharedSecret

_SECRET = "s" * 32


class _Engine:
    """An engine's answer: drained at the second status after the drain."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def control(self, request: ControlRequest) -> str:
        self.ops.append(request.op)
        if "drain" not in self.ops:
            return "serving"
        return "drained" if self.ops.count("status") >= 2 else "draining"


def test_drain_and_status_reach_the_engine_with_the_secret() -> None:
    engine, secret = _Engine(), SharedSecret(_SECRET)
    with HandshakeListener(lambda _: None, port=0, secret=secret, on_control=engine.control) as ls:
        assert request_control("127.0.0.1", ls.port, "status", secret=secret).state == "serving"
        assert request_control("127.0.0.1", ls.port, "drain", secret=secret).state == "draining"
        refused = request_control("127.0.0.1", ls.port, "drain")  # no secret: refused
        assert refused.state == "refused" and "secret" in refused.detail
        assert engine.ops == ["status", "drain"] and ls.counters["unauthenticated"] == 1


def test_a_listener_without_a_hook_refuses() -> None:
    with HandshakeListener(lambda _: None, port=0) as ls:
        reply = request_control("127.0.0.1", ls.port, "drain")
        assert reply.state == "refused" and "no operator requests" in reply.detail


def test_the_cli_drains_and_waits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVFSM_SHARED_SECRET", _SECRET)
    engine = _Engine()
    secret = SharedSecret(_SECRET)
    with HandshakeListener(lambda _: None, port=0, secret=secret, on_control=engine.control) as ls:
        assert main(["drain", f"127.0.0.1:{ls.port}", "--wait", "30"]) == 0
    assert capsys.readouterr().out.strip() == "drained"
    assert engine.ops == ["drain", "status", "status"]


def test_the_cli_says_when_nothing_answers(capsys: pytest.CaptureFixture[str]) -> None:
    with HandshakeListener(lambda _: None, port=0) as ls:
        port = ls.port
    assert main(["drain", f"127.0.0.1:{port}", "--timeout", "0.2"]) == 2
    assert "no answer" in capsys.readouterr().err
