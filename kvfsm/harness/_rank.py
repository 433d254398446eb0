"""One engine rank in a process of its own, on real NIXL and ZMQ (the demo's, the benchmarks' and
the tests' ranks).

It owns a NIXL agent, its KV cache, a handshake listener and an `EngineLoop`; its main thread
takes the driver's commands from a pipe (peers' addresses, admissions, stop, and for tests
`probe`, `fill` and `check_fill`). P's "prefill" writes each request's recognisable pattern; D
checks every byte of its share on a reporter thread, off the engine's loop, before it reports
the request received. The reporter also tells the driver of every release of blocks.
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
from kvfsm.wire import WIRE_VERSION

if TYPE_CHECKING:
    from kvfsm.core import Side
    from kvfsm.runtime import CallerOutput, Engine, KvCache

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "LoopFactory",
    "Rank",
    "RankLoop",
    "RankSpec",
    "close_rank",
    "open_rank",
    "rank_main",
]

HANDSHAKE_TIMEOUT_S = 10.0
"""How long a rank's handshake waits for a peer's listener before it fails, by default."""


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
    host: str = "127.0.0.1"  # where the handshake listener binds (a veth address across hosts)
    port: int = 0  # the listener's port (0: a free one; a restarted rank may want its old one)
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    secret: bytes = b""  # the deployment's shared secret (empty: none)


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

    def call(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run `fn(engine)` on the loop's thread."""
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
    host: str = "127.0.0.1",
    port: int = 0,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    secret: bytes = b"",
) -> Rank:
    """A NIXL agent for `core`'s side with `kv` registered (host or CUDA memory, as `kv` is), its
    engine, the ZMQ directory that reaches peers' listeners (validating their payloads against
    `kv`'s geometry) and its own listener on `host:port` (port 0: a free one); a handshake waits
    `handshake_timeout_s` for a peer's listener. The caller drives the engine (an `EngineLoop`,
    whose `wake` the directory's `on_result` should call) and closes the rank with `close_rank`.
    `secret` (if not empty): handshakes and notifications are authenticated with it; the engine
    takes notifications only from peers that completed a handshake."""
    from kvfsm.fabric import NixlFabric
    from kvfsm.runtime import Engine, Guests
    from kvfsm.sidechannel import HandshakeListener, ZmqDirectory, payload_of, validate
    from kvfsm.wire import SharedSecret

    shared = SharedSecret(secret) if secret else None

    fabric = NixlFabric(
        core.identity.agent, ucx_error_handling=ucx_error_handling, mem_type=kv.mem_type
    )
    addresses: dict[str, tuple[str, int]] = {}
    check = functools.partial(
        validate, expect_mode=core.mode, local=kv.geometry, local_is_p=core.side == "P"
    )
    directory = ZmqDirectory(
        addresses,
        compat_hash=compat_hash,
        wire_version=WIRE_VERSION,
        timeout_s=handshake_timeout_s,
        check=check,
        secret=shared,
        requester=core.identity.agent,
    )
    guests = Guests()  # who handshaked with the listener: the engine takes their notifications
    engine = Engine(
        core,
        fabric,
        kv,
        directory,
        time.monotonic,
        coalesce=coalesce,
        secret=shared,
        guests=guests,
    )
    payload = payload_of(engine, compat_hash=compat_hash, wire_version=WIRE_VERSION)
    listener = HandshakeListener(
        {engine.agent: payload}.get, host=host, port=port, secret=shared, guests=guests
    )
    return Rank(engine, fabric, directory, listener, addresses)


def _corrupt(kv: Any, block: int, loop: Any, targets: set[int] | None) -> None:
    """Flip the first byte of `block` in the first region: now, or (with `targets`, the set a
    `corrupt_bytes_after_checksum` engine checksum reads: `verify` is on) right after P takes
    the checksum of the transfer that moves it, so D's check must catch it."""
    if targets is None:
        kv.regions()[0].reshape(kv.geometry.num_blocks, kv.geometry.block_len)[block, 0] ^= 0xFF
        return
    address = int(kv.layout.descriptors()[block, 0])
    loop.call(lambda _engine: targets.add(address)).result(5)  # the checksum's thread


def close_rank(rank: Rank, loop: RankLoop) -> dict[str, int]:
    """Stop the loop (it closes the engine), then the listener, the directory and the agent;
    returns what the agent still held once the engine had closed (nothing, unless a leak)."""
    loop.stop()
    leftovers: dict[str, int] = rank.fabric.open_resources()
    rank.listener.close()
    rank.directory.close()
    rank.fabric.close()
    return leftovers


def _serve(spec: RankSpec, conn: Connection, send: _Sender, make_loop: LoopFactory | None) -> None:
    from kvfsm.runtime import (
        EngineLoop,
        KvCache,
        corrupt_bytes_after_checksum,
        status_answerer,
    )
    from kvfsm.sim import request_seed, write_request

    is_p = spec.side == "P"
    g = spec.geometry
    core = (Producer if is_p else Consumer)(
        Identity(spec.side, g.tp_rank, g.tp_size), spec.mode, spec.config
    )
    kv = KvCache.allocate(g)
    rank = open_rank(
        core,
        kv,
        compat_hash=spec.compat_hash,
        ucx_error_handling=spec.ucx_error_handling,
        host=spec.host,
        port=spec.port,
        secret=spec.secret,
        handshake_timeout_s=spec.handshake_timeout_s,
    )
    engine, directory, listener, addresses = (
        rank.engine,
        rank.directory,
        rank.listener,
        rank.addresses,
    )
    reporter = _Reporter(spec, kv, send)
    loop = (make_loop or EngineLoop)(engine, reporter.put)
    directory.on_result = loop.wake
    listener.status = status_answerer(loop)  # peers ask about transfers whose completion was lost
    # The demo's negative control with `verify` on: bytes flipped after P's checksum.
    targets: set[int] | None = None
    if is_p and spec.config.verify != "off":
        targets = set()
        engine.checksum = corrupt_bytes_after_checksum(targets)
    loop.start()
    send(("ready", listener.port))
    try:
        while (msg := conn.recv())[0] != "stop":
            if msg[0] == "peers":
                addresses.update(msg[1])
            elif msg[0] == "admit_p":
                _, key, rid, blocks, corrupt = msg
                write_request(kv, request_seed(key), blocks, unit_tokens=spec.unit_tokens)
                if corrupt:  # the negative control: one wrong byte D must notice
                    _corrupt(kv, int(blocks[0]), loop, targets)
                _watch(loop.submit(Admit(rid, blocks)), send)
                # Through the reporter, so the driver hears it before P's "finished" (which
                # the reporter sends too): sent from here, it raced that and lost on loopback.
                reporter.relay(("prefilled", key, time.monotonic()))  # hand-off starts here
                _watch(loop.submit(PrefillFinished(rid, blocks)), send)
            elif msg[0] == "admit_d":
                _, key, rid, blocks, p_rid, tokens = msg
                reporter.expect(rid, key, tokens)
                _watch(loop.submit(Admit(rid, blocks, "P", spec.peer_tp, p_rid)), send)
            else:
                _inspect(msg, kv, loop, send)
    finally:
        leftovers = close_rank(rank, loop)
        reporter.stop()
        send(("counters", dict(engine.counters + core.counters), list(loop.errors), leftovers))


def _inspect(msg: tuple[Any, ...], kv: KvCache, loop: RankLoop, send: _Sender) -> None:
    """The test hooks of the pipe protocol: what the engine holds (`probe`), and filling blocks
    the engine handed back with a byte (`fill`) to see later whether anything wrote into them
    (`check_fill`: a late write)."""
    kind = msg[0]
    if kind == "probe":
        send(("probe", loop.call(_holdings).result(timeout=30.0)))
    elif kind in ("fill", "check_fill"):
        _, blocks, byte = msg
        g = kv.geometry
        rows = [region.reshape(g.num_blocks, -1) for region in kv.regions()]
        if kind == "fill":
            for row in rows:
                row[blocks] = byte
            send(("filled",))
        else:
            send(("fill_check", sum(int((row[blocks] != byte).sum()) for row in rows)))
    else:
        send(("error", f"unknown command {kind!r}"))


def _holdings(engine: Engine) -> dict[str, int]:
    """What an engine still holds: live requests, transfers in flight, armed deadlines, and its
    agent's handles, lists, peers and registrations (run on the loop's thread)."""
    side = engine.side
    held = {"requests": len(side.requests), "inflight": len(engine.inflight)}
    held["deadlines"] = len(side.deadlines)
    held["held_blocks"] = len(side.quarantine)  # given up, while late bytes may still land
    resources: dict[str, int] = engine.fabric.open_resources()  # type: ignore[attr-defined]
    return held | resources


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

    def relay(self, msg: tuple[Any, ...]) -> None:
        """Send `msg` to the driver after every output put before it, and before any put after."""
        self._queue.put((msg, time.monotonic()))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        from kvfsm.core import ReleaseBlocks, ReportFailed, ReportReceived
        from kvfsm.runtime import RequestTrace
        from kvfsm.sim import check_request, request_seed

        while (item := self._queue.get()) is not None:
            out, at = item
            if isinstance(out, tuple):  # relayed
                self._send(out)
            elif isinstance(out, ReportReceived):
                key, tokens = self._expected.pop(out.request_id)
                check = check_request(
                    self._kv,
                    request_seed(key),
                    out.blocks,
                    unit_tokens=self._spec.unit_tokens,
                    first_token=0,
                    tokens=tokens,
                )
                self._send(("received", out.request_id, check.compared, check.wrong, at))
            elif isinstance(out, ReportFailed):
                self._expected.pop(out.request_id, None)
                self._send(("failed", out.request_id))
            elif isinstance(out, ReleaseBlocks):  # a leak or double release shows here
                self._send(("released", out.request_id, [int(b) for b in out.blocks]))
            elif isinstance(out, RequestTrace):
                stats = msgspec.to_builtins(out.stats)
                self._send(("finished", out.request_id, out.state, out.history, stats))
