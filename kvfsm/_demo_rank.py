"""One engine rank of `kvfsm demo --fabric nixl`, in a process of its own.

It owns a NIXL agent, its KV cache, a handshake listener and an `EngineLoop`; its main thread
takes the driver's commands from a pipe (peers' addresses, admissions, stop). P's "prefill"
writes each request's recognisable pattern; D checks every byte of its share on a reporter
thread, off the engine's loop, before it reports the request received.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import msgspec

from kvfsm.core import (
    Admit,
    Consumer,
    CoreConfig,
    Event,
    Identity,
    Mode,
    PrefillFinished,
    Producer,
)
from kvfsm.fabric import UCX_ERROR_HANDLING_DEFAULT, UcxErrorHandling
from kvfsm.layout import KvGeometry

if TYPE_CHECKING:
    from kvfsm.core import Side
    from kvfsm.runtime import CallerOutput, Engine, KvCache

__all__ = ["LoopFactory", "Rank", "RankLoop", "RankSpec", "close_rank", "open_rank", "rank_main"]

WIRE_VERSION = 1


class RankSpec(msgspec.Struct, frozen=True):
    """What one rank process needs to know."""

    side: str  # "P" or "D"
    mode: Mode
    geometry: KvGeometry  # this rank's
    peer_tp: int
    unit_tokens: int  # the smaller of the two sides' block sizes
    compat_hash: str
    ucx_error_handling: UcxErrorHandling = UCX_ERROR_HANDLING_DEFAULT
    config: CoreConfig = msgspec.field(default_factory=CoreConfig)


class RankLoop(Protocol):
    """What a rank needs of the thread that drives its engine (`EngineLoop`, or a benchmark's
    comparison loop)."""

    errors: Any

    def start(self) -> Any:
        """Start driving the engine."""
        ...

    def submit(self, event: Event) -> Future[None]:
        """Hand the engine an event."""
        ...

    def wake(self) -> None:
        """Something happened off the loop (a handshake finished)."""
        ...

    def stop(self, drain_s: float = 0.0, timeout: float | None = 30.0) -> None:
        """Stop driving and close the engine."""
        ...


LoopFactory = Callable[["Engine", Callable[["CallerOutput"], None]], RankLoop]
"""Builds the loop of a rank from its engine and the callback for the engine's outputs."""


def rank_main(spec: RankSpec, conn: Connection, make_loop: LoopFactory | None = None) -> None:
    """The body of a rank process (the `multiprocessing` target); `make_loop` replaces the
    `EngineLoop` (a benchmark comparing loops)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO to stdout; --json owns it
    send = _Sender(conn)
    try:
        _serve(spec, conn, send, make_loop)
    except BaseException as exc:  # report, then die: the driver fails the run saying why
        send(("error", f"{spec.side}#{spec.geometry.tp_rank}: {exc!r}"))
        raise


class Rank(NamedTuple):
    """An engine rank on real NIXL, reachable for handshakes: what `open_rank` builds."""

    engine: Engine
    fabric: Any  # NixlFabric
    directory: Any  # ZmqDirectory
    listener: Any  # HandshakeListener
    addresses: dict[str, tuple[str, int]]
    """Peer agent -> (host, port) of its listener: the caller fills it in."""


def open_rank(
    core: Side,
    kv: KvCache,
    *,
    compat_hash: str,
    ucx_error_handling: UcxErrorHandling = UCX_ERROR_HANDLING_DEFAULT,
    coalesce: bool = False,
) -> Rank:
    """A NIXL agent for `core`'s side with `kv` registered, its engine, the ZMQ directory that
    reaches peers' listeners (validating their payloads against `kv`'s geometry) and its own
    listener. The caller drives the engine (an `EngineLoop`, whose `wake` the directory's
    `on_result` should call) and closes the rank with `close_rank`."""
    from kvfsm.fabric import NixlFabric
    from kvfsm.runtime import Engine
    from kvfsm.sidechannel import HandshakeListener, ZmqDirectory, payload_of, validate

    fabric = NixlFabric(core.identity.agent, ucx_error_handling=ucx_error_handling)
    addresses: dict[str, tuple[str, int]] = {}
    check = functools.partial(
        validate, expect_mode=core.mode, local=kv.geometry, local_is_p=core.side == "P"
    )
    directory = ZmqDirectory(
        addresses, compat_hash=compat_hash, wire_version=WIRE_VERSION, timeout_s=10.0,
        check=check,
    )  # fmt: skip
    engine = Engine(core, fabric, kv, directory, time.monotonic, coalesce=coalesce)
    payload = payload_of(engine, compat_hash=compat_hash, wire_version=WIRE_VERSION)
    listener = HandshakeListener({engine.agent: payload}.get)
    return Rank(engine, fabric, directory, listener, addresses)


def close_rank(rank: Rank, loop: RankLoop) -> None:
    """Stop the loop (it closes the engine), then the listener, the directory and the agent."""
    loop.stop()
    rank.listener.close()
    rank.directory.close()
    rank.fabric.close()


def _serve(spec: RankSpec, conn: Connection, send: _Sender, make_loop: LoopFactory | None) -> None:
    from kvfsm.runtime import EngineLoop, KvCache
    from kvfsm.testing import request_seed, write_request

    is_p = spec.side == "P"
    g = spec.geometry
    core = (Producer if is_p else Consumer)(
        Identity(spec.side, g.tp_rank, g.tp_size), spec.mode, spec.config
    )
    kv = KvCache.allocate(g)
    rank = open_rank(
        core, kv, compat_hash=spec.compat_hash, ucx_error_handling=spec.ucx_error_handling
    )
    engine, directory, listener, addresses = (
        rank.engine, rank.directory, rank.listener, rank.addresses
    )  # fmt: skip
    reporter = _Reporter(spec, kv, send)
    loop = (make_loop or EngineLoop)(engine, reporter.put)
    directory.on_result = loop.wake
    loop.start()
    send(("ready", listener.port))
    try:
        while True:
            msg: tuple[Any, ...] = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "peers":
                addresses.update(msg[1])
            elif msg[0] == "admit_p":
                _, key, rid, blocks, corrupt = msg
                write_request(kv, request_seed(key), blocks, unit_tokens=spec.unit_tokens)
                if corrupt:  # the negative control: one wrong byte D must notice
                    kv.regions()[0].reshape(g.num_blocks, g.block_len)[blocks[0], 0] ^= 0xFF
                _watch(loop.submit(Admit(rid, blocks)), send)
                _watch(loop.submit(PrefillFinished(rid, blocks)), send)
                send(("prefilled", key, time.monotonic()))  # hand-off latency starts here
            elif msg[0] == "admit_d":
                _, key, rid, blocks, p_rid, tokens = msg
                reporter.expect(rid, key, tokens)
                _watch(loop.submit(Admit(rid, blocks, "P", spec.peer_tp, p_rid)), send)
    finally:
        close_rank(rank, loop)
        reporter.stop()
        send(("counters", dict(engine.counters + core.counters), list(loop.errors)))


class _Sender:
    """`conn.send` for several threads."""

    def __init__(self, conn: Connection) -> None:
        self._conn, self._lock = conn, threading.Lock()

    def __call__(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            self._conn.send(msg)


def _watch(future: Any, send: _Sender) -> None:
    """Tell the driver if the engine refused an event (a caller's protocol error)."""

    def report(done: Any) -> None:
        if done.exception() is not None:
            send(("error", repr(done.exception())))

    future.add_done_callback(report)


class _Reporter:
    """Takes the engine's outputs (on the loop's thread: only queues them), checks D's bytes and
    tells the driver, in order, on a thread of its own."""

    def __init__(self, spec: RankSpec, kv: Any, send: _Sender) -> None:
        self._spec, self._kv, self._send = spec, kv, send
        self._expected: dict[str, tuple[str, int]] = {}  # D request id -> (key, tokens)
        self._queue: queue.SimpleQueue[tuple[Any, float] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvfsm-demo-reporter", daemon=True)
        self._thread.start()

    def expect(self, rid: str, key: str, tokens: int) -> None:
        self._expected[rid] = (key, tokens)

    def put(self, output: Any) -> None:
        self._queue.put((output, time.monotonic()))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        from kvfsm.core import ReportFailed, ReportReceived
        from kvfsm.runtime import RequestTrace
        from kvfsm.testing import check_request, request_seed

        while (item := self._queue.get()) is not None:
            out, at = item
            if isinstance(out, ReportReceived):
                key, tokens = self._expected.pop(out.request_id)
                check = check_request(
                    self._kv, request_seed(key), out.blocks, unit_tokens=self._spec.unit_tokens,
                    first_token=0, tokens=tokens,
                )  # fmt: skip
                self._send(("received", out.request_id, check.compared, check.wrong, at))
            elif isinstance(out, ReportFailed):
                self._expected.pop(out.request_id, None)
                self._send(("failed", out.request_id))
            elif isinstance(out, RequestTrace):
                stats = msgspec.to_builtins(out.stats)
                self._send(("finished", out.request_id, out.state, out.history, stats))
