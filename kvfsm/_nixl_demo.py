"""`kvfsm demo --fabric nixl`: a P and a D engine in separate processes over real NIXL (UCX, DRAM),
the handshake over ZMQ on loopback, every byte D receives checked against what P's prefill wrote.

Each engine process owns its NIXL agent, its KV region and a handshake listener, and runs its
engine from one thread; the parent admits requests (blocks from its own allocators, as a serving
engine's scheduler would) and collects outcomes through a pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections import Counter
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from kvfsm._demo import DemoReport, time_in_state
from kvfsm.core import (
    Admit,
    Consumer,
    CoreConfig,
    Finished,
    Identity,
    Mode,
    PrefillFinished,
    Producer,
    ReportReceived,
)
from kvfsm.layout import BlockLayout

__all__ = ["LLAMA3_8B_BLOCK_BYTES", "run_nixl_demo"]

# Llama-3-8B: 32 layers x (K, V) x 8 KV heads x head dim 128 x fp16 x 16 tokens per block.
LLAMA3_8B_BLOCK_BYTES = 32 * 2 * 8 * 128 * 2 * 16
_WIRE = 1
_HASH = "kvfsm-demo"


def _pattern(key: str, n: int, block_bytes: int) -> np.ndarray:
    """The bytes P's prefill writes for request `key`: position-dependent, so D can check them."""
    seed = sum(key.encode()) & 0xFF
    row = (np.arange(block_bytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(
        np.uint8
    )
    return np.stack([row ^ np.uint8((seed + 31 * i) & 0xFF) for i in range(n)])


def _engine_main(side: str, mode: Mode, layout: BlockLayout, conn: Connection, port: int) -> None:
    """An engine process: NIXL agent, handshake listener, engine loop driven by the parent."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO to stdout; --json owns it
    from kvfsm.fabric import NixlFabric
    from kvfsm.runtime import Engine
    from kvfsm.sidechannel import HandshakeListener, HandshakePayload, ZmqDirectory

    engine_id = "P" if side == "P" else "D"
    core = (Producer if side == "P" else Consumer)(Identity(engine_id), mode, CoreConfig())
    fabric = NixlFabric(core.identity.agent)
    kv = np.zeros(layout.nbytes, dtype=np.uint8)
    peer_ports: dict[str, tuple[str, int]] = {}
    directory = ZmqDirectory(peer_ports, compat_hash=_HASH, wire_version=_WIRE, timeout_s=10.0)
    engine = Engine(core, fabric, kv, layout, directory, time.monotonic)
    payload = HandshakePayload(
        engine_id=engine_id, agent=engine.agent, rank=0, tp_size=1,
        agent_metadata=fabric.get_agent_metadata(), base_address=int(kv.ctypes.data),
        num_blocks=layout.num_blocks, block_bytes=layout.block_bytes, kv_layout="blocks",
        block_size=16, mode=mode, wire_version=_WIRE, compat_hash=_HASH,
    )  # fmt: skip
    listener = HandshakeListener({engine.agent: payload}.get, port=0)
    conn.send(("ready", listener.port))
    blocks_view = kv.reshape(layout.num_blocks, layout.block_bytes)
    try:
        while True:
            if conn.poll():
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                _apply(msg, engine, blocks_view, peer_ports, layout, conn)
            engine.poll()
            for out in engine.take_outputs():
                _report(out, conn, blocks_view, layout)
            wait([conn], timeout=0.0002)  # wake on the parent's next command, else poll again
    finally:
        engine.close()
        listener.close()
        directory.close()
        fabric.close()


def _apply(msg: tuple[Any, ...], engine: Any, kv: np.ndarray, peers: dict[str, tuple[str, int]],
           layout: BlockLayout, conn: Connection) -> None:  # fmt: skip
    kind = msg[0]
    if kind == "peer":
        peers[msg[1]] = ("127.0.0.1", msg[2])
    elif kind == "admit_p":
        _, key, rid, blocks = msg
        kv[blocks] = _pattern(key, len(blocks), layout.block_bytes)
        engine.submit(Admit(rid, blocks))
        engine.submit(PrefillFinished(rid, blocks))
        conn.send(("prefilled", key, time.monotonic()))  # hand-off latency starts here
    elif kind == "admit_d":
        _, key, rid, blocks, p_rid = msg
        engine.submit(Admit(rid, blocks, "P", 1, p_rid))


def _report(out: Any, conn: Connection, kv: np.ndarray, layout: BlockLayout) -> None:
    if isinstance(out, ReportReceived):
        key = out.request_id.rsplit("-", 1)[0]
        expected = _pattern(key, len(out.blocks), layout.block_bytes)
        ok = bool(np.array_equal(kv[out.blocks], expected))
        conn.send(("received", out.request_id, ok, int(expected.nbytes), time.monotonic()))
    elif isinstance(out, Finished):
        conn.send(("finished", out.request_id, out.state, out.history, time.monotonic()))


def run_nixl_demo(
    mode: Mode, requests: int, *, seed: int = 0, memory_mib: int = 256, max_blocks: int = 8,
    progress: Any = None,
) -> DemoReport:  # fmt: skip
    """P and D engine processes over real NIXL; `requests` random-length requests."""
    cpu0 = time.process_time()
    layout = BlockLayout(max(8, memory_mib * 2**20 // LLAMA3_8B_BLOCK_BYTES), LLAMA3_8B_BLOCK_BYTES)
    ctx = mp.get_context("spawn")
    pipes, procs, ports = {}, {}, {}
    for side in ("P", "D"):
        parent, child = ctx.Pipe()
        procs[side] = ctx.Process(
            target=_engine_main, args=(side, mode, layout, child, 0), daemon=True
        )
        procs[side].start()
        pipes[side] = parent
    try:
        for side in ("P", "D"):
            if not pipes[side].poll(60):
                raise RuntimeError(f"the {side} engine process did not start within 60 s")
            ports[side] = pipes[side].recv()[1]
        pipes["P"].send(("peer", "D#0", ports["D"]))
        pipes["D"].send(("peer", "P#0", ports["P"]))
        return _drive(mode, requests, seed, layout, max_blocks, pipes, progress, cpu0)
    finally:
        for side in ("P", "D"):
            pipes[side].send(("stop",))
        for proc in procs.values():
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _drive(mode: Mode, requests: int, seed: int, layout: BlockLayout, max_blocks: int,
           pipes: dict[str, Connection], progress: Any, cpu0: float) -> DemoReport:  # fmt: skip
    rng = random.Random(seed)
    free = {"P": list(range(layout.num_blocks)), "D": list(range(layout.num_blocks))}
    held: dict[str, tuple[str, list[int]]] = {}  # request id -> (side, blocks)
    states: list[str] = []
    histories: list[tuple[str, Any]] = []
    t0 = time.monotonic()
    verified: bool = True
    moved = admitted = done_pairs = 0
    keys: dict[str, str] = {}  # D request id -> request key
    prefilled: dict[str, float] = {}  # request key -> when P's prefill ended (P's clock)
    handoff_ms: list[float] = []
    deadline = time.monotonic() + max(120.0, requests * 0.5)
    while done_pairs < requests or held:  # P may end after D (pull: on D's notification)
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {done_pairs} of {requests} requests ended in time")
        while admitted < requests:
            n = rng.randint(1, max_blocks)
            if min(len(free["P"]), len(free["D"])) < n:
                break
            key = f"req{admitted}"
            admitted += 1
            p_blocks = [free["P"].pop(rng.randrange(len(free["P"]))) for _ in range(n)]
            d_blocks = [free["D"].pop(rng.randrange(len(free["D"]))) for _ in range(n)]
            p_rid, d_rid = f"{key}-{rng.getrandbits(32):08x}", f"{key}-{rng.getrandbits(32):08x}"
            held[p_rid], held[d_rid] = ("P", p_blocks), ("D", d_blocks)
            keys[d_rid] = key
            pipes["P"].send(("admit_p", key, p_rid, np.array(p_blocks, dtype=np.int32)))
            pipes["D"].send(("admit_d", key, d_rid, np.array(d_blocks, dtype=np.int32), p_rid))
        for conn in wait(list(pipes.values()), timeout=1.0):
            msg: tuple[Any, ...] = conn.recv()  # type: ignore[union-attr,call-arg,assignment]
            if msg[0] == "received":
                verified = verified and bool(msg[2])
                moved += msg[3]
                # P and D run on one host: time.monotonic is one clock for both processes.
                handoff_ms.append((msg[4] - prefilled[keys[msg[1]]]) * 1e3)
            elif msg[0] == "prefilled":
                prefilled[msg[1]] = msg[2]
            elif msg[0] == "finished":
                side, blocks = held.pop(msg[1])
                free[side].extend(blocks)
                states.append(msg[2])
                histories.append((side, msg[3]))
                if side == "D":
                    done_pairs += 1
                    if progress is not None:
                        progress(1)
    wall = time.monotonic() - t0
    d_states = [state for (side, _), state in zip(histories, states, strict=True) if side == "D"]
    p50, p99 = (float(np.percentile(handoff_ms, q)) for q in (50, 99))
    return DemoReport(
        mode=mode, fabric="nixl", requests=requests, done=d_states.count("done"),
        failed=d_states.count("failed"), expired=d_states.count("expired"),
        aborted=d_states.count("aborted"), bytes=moved,
        verified=verified and len(handoff_ms) == d_states.count("done"),
        violations=[f"{len(held)} requests never ended"] if held else [],
        p_tp=1, d_tp=1, finals=dict(Counter(f"{side}:{s}" for (side, _), s in zip(histories, states, strict=True))),
        time_in_state_ms=time_in_state(histories), counters={},
        simulated_s=0.0, cpu_s=time.process_time() - cpu0, wall_s=round(wall, 3),
        gbps=round(moved / wall / 1e9, 3), handoff_ms_p50=round(p50, 3), handoff_ms_p99=round(p99, 3),
    )  # fmt: skip
