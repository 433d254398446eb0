"""Every handshake failure fails the waiting request with its blocks reported invalid, and the engine
keeps serving: the next request, once P is reachable, completes with every byte checked.

D's engine runs on a real NIXL agent and handshakes over real ZMQ on loopback (`ZmqDirectory`);
P is a real engine behind a real `HandshakeListener`, or a stand-in that misbehaves."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvfsm.core import (
    Admit,
    Consumer,
    Finished,
    Identity,
    Mode,
    PrefillFinished,
    Producer,
    ReportFailed,
    ReportReceived,
)
from kvfsm.fabric import NixlFabric
from kvfsm.layout import KvGeometry
from kvfsm.runtime import Engine, KvCache
from kvfsm.sidechannel import HandshakeListener, HandshakePayload, ZmqDirectory, payload_of
from kvfsm.sim import check_request, request_seed, write_request
from kvfsm.testing import free_port

pytestmark = pytest.mark.nixl

_HASH, _WIRE = "test-hash", 1
_GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=2, head_dim=64, dtype_bytes=2, block_size=8, num_blocks=16
)
_ids = itertools.count()


def _engine(side: str, name: str, mode: Mode, addresses: dict[str, tuple[str, int]]) -> Engine:
    core = (Producer if side == "P" else Consumer)(Identity(name), mode)
    kv = KvCache.allocate(_GEOMETRY)
    directory = ZmqDirectory(addresses, compat_hash=_HASH, wire_version=_WIRE, timeout_s=0.5)
    return Engine(core, NixlFabric(core.identity.agent), kv, directory, time.monotonic)


def _payload(engine: Engine, **changes: object) -> HandshakePayload:
    payload = payload_of(engine, compat_hash=_HASH, wire_version=_WIRE)
    return msgspec.structs.replace(payload, **changes)


def _raw_server(answer: Callable[[list[bytes]], list[bytes] | None]) -> Iterator[int]:
    """A ROUTER socket on its own thread that answers each request with `answer` (None: silence)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                frames = sock.recv_multipart()
                reply = answer(frames)
                if reply is not None:
                    sock.send_multipart(frames[:-1] + reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join()
        sock.close(0)
        ctx.term()


def _run(engines: list[Engine], until: Callable[[], bool], limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not until():
        assert time.monotonic() < deadline, "bounded wait ran out"
        for engine in engines:
            engine.poll()


@pytest.fixture
def p_side() -> Iterator[tuple[Engine, HandshakeListener, dict[str, tuple[str, int]]]]:
    n = next(_ids)
    p_addresses: dict[str, tuple[str, int]] = {}  # how P reaches D ranks
    engine = _engine("P", f"P{n}", "push", p_addresses)
    listener = HandshakeListener({engine.agent: _payload(engine)}.get)
    yield engine, listener, p_addresses
    listener.close()
    engine.close()
    engine.directory.close()  # type: ignore[attr-defined]
    engine.fabric.close()


FAILURES = ["nothing listening", "silence", "hash mismatch", "wrong engine", "garbage", "geometry"]


@pytest.mark.parametrize("failure", FAILURES)
def test_handshake_failure_fails_the_request_and_the_engine_goes_on(
    p_side: tuple[Engine, HandshakeListener, dict[str, tuple[str, int]]], failure: str
) -> None:
    p, listener, p_addresses = p_side
    p_name = p.side.identity.engine_id
    addresses: dict[str, tuple[str, int]] = {}
    d = _engine("D", f"D{next(_ids)}", "push", addresses)
    d_listener = HandshakeListener({d.agent: _payload(d)}.get)
    p_addresses[d.agent] = ("127.0.0.1", d_listener.port)
    outputs: list[object] = []
    servers: list[Iterator[int]] = []
    try:
        if failure == "nothing listening":
            port = free_port()
        elif failure in ("hash mismatch", "wrong engine", "geometry"):
            bads: dict[str, dict[str, Any]] = {
                "hash mismatch": {"compat_hash": "another-model"},
                "wrong engine": {"engine_id": "X", "agent": "X#0"},
                "geometry": {"block_lens": (1, 1)},
            }
            bad_listener = HandshakeListener({p.agent: _payload(p, **bads[failure])}.get)
            servers.append(iter([]))
            port = bad_listener.port
        else:
            gen = _raw_server(
                (lambda f: [b"\x00garbage"]) if failure == "garbage" else (lambda f: None)
            )
            port = next(gen)
            servers.append(gen)
        addresses[p.agent] = ("127.0.0.1", port)
        blocks = np.array([1, 2], dtype=np.int32)
        d.submit(Admit("r1-0000000b", blocks, p_name, 1, ""))

        def ended() -> bool:
            outputs.extend(d.take_outputs())
            return any(isinstance(o, Finished) for o in outputs)

        _run([d], ended)
        names = [type(o).__name__ for o in outputs]
        assert names == ["ReportFailed", "ReleaseBlocks", "Finished", "RequestTrace"]
        assert isinstance(outputs[0], ReportFailed) and list(outputs[0].blocks) == [1, 2]
        assert outputs[2].state == "failed"  # type: ignore[attr-defined]
        assert d.counters["handshake_failed"] == 1

        # The engine keeps serving: P is reachable now, the next request moves verified bytes.
        addresses[p.agent] = ("127.0.0.1", listener.port)
        p_blocks = np.array([5, 6], dtype=np.int32)
        write_request(p.kv, request_seed("r2"), p_blocks, unit_tokens=8)
        p.submit(Admit("r2-0000000a", p_blocks))
        p.submit(PrefillFinished("r2-0000000a", p_blocks))
        d.submit(Admit("r2-0000000b", np.array([3, 4], dtype=np.int32), p_name, 1, ""))
        got: list[object] = []

        def both_done() -> bool:
            got.extend(d.take_outputs())
            return any(isinstance(o, Finished) for o in got)

        _run([p, d], both_done)
        assert [o.state for o in got if isinstance(o, Finished)] == ["done"]
        assert any(isinstance(o, ReportReceived) for o in got)
        check = check_request(
            d.kv, request_seed("r2"), [3, 4], unit_tokens=8, first_token=0, tokens=16
        )
        assert check.compared == 2 * d.kv.block_bytes and check.wrong == 0
    finally:
        if failure in ("hash mismatch", "wrong engine", "geometry"):
            bad_listener.close()
        for gen in servers:
            for _ in gen:
                pass
        d_listener.close()
        d.close()
        d.directory.close()  # type: ignore[attr-defined]
        d.fabric.close()
