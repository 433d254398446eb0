"""`kvfsm bench`, the engine's rows: the kvfsm engine moving the same blocks as the raw variants,
(b) posting one prepared row per block per region, as vLLM's connector does, and (c) coalescing
rows adjacent on both sides before it posts.

P and D run in processes of their own, each an `Engine` on its `EngineLoop` over NIXL with the
handshake on a real side channel, exactly as a serving rank runs it. P admits every request and
finishes its prefill up front; D then admits them with at most `plan.inflight` waiting, so the
figures include everything the engine does per request (registration, matching, the transfer,
its completion notification). D, the sink in both modes, checks every byte at the end.

Each request's hand-off runs from D's admission (P's prefill has finished by then) to D's report,
and is split into hops from both sides' traces (`HOPS`): where the time beyond the copy goes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvfsm.bench._memory import on_host
from kvfsm.bench._raw import BenchPlan, check_sink, kv_buffer, recv_bounded
from kvfsm.core import ReportFailed, ReportReceived
from kvfsm.layout import KvGeometry
from kvfsm.runtime import RequestTrace

__all__ = ["HOPS", "bench_geometry", "handoff_hops", "run_engine_variant"]

_TOKENS, _DTYPE = 16, 2
_BOUND_S = 120.0
_IDLE_S = 0.5  # how long each rank is watched idle after the run, for its CPU per idle second

HOPS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "push": (
        ("D registers", "D", "registered"),
        ("registration at P", "P", "on registration"),
        ("post", "P", "writing"),
        ("DONE at P", "P", "done"),
        ("notification at D", "D", "done"),
        ("report", "D", "reported"),
    ),
    "pull": (
        ("D registers", "D", "registered"),
        ("registration at P", "P", "on registration"),
        ("post", "D", "reading"),
        ("DONE at D", "D", "done"),
        ("report", "D", "reported"),
    ),
}
"""A hand-off's points in order, by mode: (hop's name, side, what happens there: a state entered,
"on" an event, or "reported": the driver has D's report). A hop's time runs from the point
before it (D's admission first)."""


def bench_geometry(plan: BenchPlan) -> KvGeometry:
    """A one-rank geometry whose regions and blocks are the plan's (latent KV: one head, one
    region per layer, so a block in a region is `plan.block_bytes`)."""
    head_dim, rest = divmod(plan.block_bytes, _TOKENS * _DTYPE)
    if rest:
        raise ValueError(
            f"blocks of {plan.block_bytes} bytes: need a multiple of {_TOKENS * _DTYPE}"
        )
    return KvGeometry(
        num_layers=plan.regions,
        num_kv_heads=1,
        head_dim=head_dim,
        dtype_bytes=_DTYPE,
        block_size=_TOKENS,
        num_blocks=plan.num_blocks,
        mla=True,
        interleaved=plan.blocks_first,
    )


def _rank(side: str, plan: BenchPlan, coalesce: bool, verify: str, conn: Connection) -> None:
    """One rank process: serve the driver's steps, then report figures."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvfsm.core import Consumer, CoreConfig, Identity, Producer
    from kvfsm.harness import close_rank, open_rank
    from kvfsm.runtime import EngineLoop, KvCache, status_answerer
    from kvfsm.sidechannel import compat_hash
    from kvfsm.wire import WIRE_VERSION

    is_p = side == "P"
    mode = plan.mode
    g = bench_geometry(plan)
    config = msgspec.convert({"verify": verify}, CoreConfig)
    core = (Producer if is_p else Consumer)(Identity(side), mode, config)
    buf = kv_buffer(plan, is_p)
    rank = open_rank(
        core,
        KvCache(g, [buf]),
        coalesce=coalesce,
        compat_hash=compat_hash(
            wire_version=WIRE_VERSION, mode=mode, model="bench", dtype="bf16", geometry=g
        ),
        ucx_error_handling=plan.error_handling("engine"),
    )
    outputs = _Outputs()
    loop = EngineLoop(rank.engine, outputs.put)
    rank.directory.on_result = loop.wake
    rank.listener.status = status_answerer(loop)
    loop.start()
    try:
        conn.send(("ready", rank.engine.agent, rank.listener.port))
        rank.addresses.update(conn.recv())
        serve = _producer if is_p else _consumer
        result = serve(plan, loop, outputs, conn)
        result["idle_cpu_per_s"] = _idle_cpu()
        if not is_p:
            result["verified"] = result["verified"] and check_sink(plan, on_host(buf))
        conn.send(("ok", result))
    except Exception as exc:  # report, the driver fails the run saying why
        conn.send(("error", f"{side}: {exc!r}"))
    finally:
        close_rank(rank, loop)


class _Outputs:
    """The engine's outputs, taken on its loop's thread the way a serving engine's connector
    takes them: counted under a lock, no thread woken. Only the reports the driver waits for go
    to its queue (one wake-up per request, not one per output)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.traced = self.posted = self.moved = 0  # guarded by _ended
        self.histories: dict[str, tuple[tuple[str, str, float], ...]] = {}  # by `_key`
        self._ended = threading.Condition()

    def put(self, out: Any) -> None:
        """Take one output (on the loop's thread)."""
        if isinstance(out, ReportReceived | ReportFailed):
            self.queue.put(out)
            return
        if isinstance(out, RequestTrace):  # it follows its request's `Finished`
            with self._ended:
                self.traced += 1
                if not out.request_id.startswith("warmup"):
                    # Rows the engine posted, and rows NIXL moved after its own merging.
                    self.posted += out.stats.descriptors
                    self.moved += out.stats.fabric_descriptors
                    self.histories[_key(out.request_id)] = out.history
                self._ended.notify_all()

    def get(self, deadline: float) -> Any:
        """The next report (D), waiting until `deadline` at most."""
        return self.queue.get(timeout=max(0.0, deadline - time.monotonic()))

    def wait_ended(self, n: int, deadline: float) -> None:
        """Wait, without spending CPU, for the n-th request to end and its trace to arrive."""
        with self._ended:
            if not self._ended.wait_for(
                lambda: self.traced >= n, max(0.0, deadline - time.monotonic())
            ):
                raise TimeoutError(f"{self.traced} of {n} requests ended")

    def until_finished(self, n: int, deadline: float) -> dict[str, Any]:
        """Wait for the n-th request to end and its trace to arrive; then the rows posted and
        moved, and when each request first reached each state and took each event ("on" it)."""
        self.wait_ended(n, deadline)
        with self._ended:
            histories = dict(self.histories)
            figures: dict[str, Any] = {"descriptors": self.posted, "fabric_descriptors": self.moved}
        # Off the loop's thread, after the timed run: the traces are kept as they came.
        entered: dict[str, dict[str, float]] = {}
        for key, history in histories.items():
            points = entered[key] = {}
            for event, state, t in history:
                points.setdefault(state, t)
                points.setdefault(f"on {event}", t)
        return figures | {"entered": entered}


def _producer(plan: BenchPlan, loop: Any, outputs: _Outputs, conn: Connection) -> dict[str, Any]:
    from kvfsm.core import Admit, PrefillFinished

    futures = []
    for i, blocks in [(-1, plan.src[0]), *enumerate(plan.src)]:
        ids = _ids(blocks)
        futures.append(loop.submit(Admit(_rid(i, "a"), ids)))
        futures.append(loop.submit(PrefillFinished(_rid(i, "a"), ids)))
    for future in futures:
        future.result(_BOUND_S)
    conn.send(("admitted",))
    conn.recv()  # D's warm-up request arrived: the timed run starts
    cpu0 = time.process_time()
    # P's part ends with its last request, not when the driver hears from D (which checks
    # every byte first): P's CPU while it waits for that is not the hand-off's.
    outputs.wait_ended(len(plan.src) + 1, time.monotonic() + _BOUND_S)
    cpu = time.process_time() - cpu0
    conn.recv()  # D received every request
    return {"cpu_s": cpu} | outputs.until_finished(len(plan.src) + 1, time.monotonic() + _BOUND_S)


def _consumer(plan: BenchPlan, loop: Any, outputs: _Outputs, conn: Connection) -> dict[str, Any]:
    from kvfsm.core import Admit, ReportFailed, ReportReceived

    # A warm-up request first (request 0's blocks, the same bytes): the handshake, UCX's
    # connection and the descriptor lists are set up outside the timed run, as the raw
    # variants prepare theirs before timing.
    conn.recv()  # P admitted every request
    loop.submit(Admit(_rid(-1, "b"), _ids(plan.dst[0]), "P", 1, _rid(-1, "a")))
    deadline = time.monotonic() + _BOUND_S
    while not isinstance(out := outputs.get(deadline), ReportReceived | ReportFailed):
        pass
    if isinstance(out, ReportFailed):
        raise RuntimeError(f"the warm-up request failed: {out}")
    conn.send(("warm",))
    conn.recv()  # go
    started: dict[str, float] = {}
    admitted: dict[str, float] = {}
    reported: dict[str, float] = {}
    failed = 0
    cpu0, t0 = time.process_time(), time.monotonic()
    deadline = time.monotonic() + _BOUND_S
    for i in range(len(plan.dst) + plan.inflight):
        while started and (len(started) >= plan.inflight or i >= len(plan.dst)):
            out = outputs.get(deadline)
            if isinstance(out, ReportReceived | ReportFailed):
                started.pop(out.request_id)
                reported[_key(out.request_id)] = time.monotonic()
                failed += isinstance(out, ReportFailed)
        if i < len(plan.dst):
            started[_rid(i, "b")] = admitted[_key(_rid(i, "b"))] = time.monotonic()
            loop.submit(Admit(_rid(i, "b"), _ids(plan.dst[i]), "P", 1, _rid(i, "a")))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    latencies = [reported[key] - at for key, at in admitted.items()]
    figures = {
        "wall_s": wall,
        "cpu_s": cpu,
        "latency_s": latencies,
        "verified": failed == 0,
        "admitted": admitted,
        "reported": reported,
    }
    return figures | outputs.until_finished(len(plan.dst) + 1, deadline)


def _idle_cpu() -> float:
    """CPU seconds this process takes per second with nothing in flight (every request over):
    near 0 unless something spins."""
    cpu0, t0 = time.process_time(), time.monotonic()
    time.sleep(_IDLE_S)
    return (time.process_time() - cpu0) / (time.monotonic() - t0)


def _rid(i: int, side: str) -> str:
    return f"{'warmup' if i < 0 else f'bench{i}'}-000000{side}{side}"


def _key(request_id: str) -> str:
    """What P's and D's ids of one request share (`bench7`)."""
    return request_id.split("-")[0]


def _ids(blocks: list[int]) -> npt.NDArray[np.int32]:
    return np.asarray(blocks, dtype=np.int32)


def run_engine_variant(plan: BenchPlan, *, coalesce: bool, verify: str = "off") -> dict[str, Any]:
    """The engine's run (b, c with `coalesce`, or b with `verify`): wall time, D's per-request
    latency (admit to received), the posting side's CPU, descriptor counts and whether every
    byte arrived."""
    ctx = mp.get_context("spawn")
    pipes = {side: ctx.Pipe() for side in ("P", "D")}
    variant = "coalesced" if coalesce else "engine" if verify == "off" else "verified"
    procs = [
        ctx.Process(
            target=_rank,
            args=(side, plan, coalesce, verify, child),
            daemon=True,
            name=f"{variant} {side}",
        )
        for side, (_, child) in pipes.items()
    ]
    for p in procs:
        p.start()
    p_conn, d_conn = pipes["P"][0], pipes["D"][0]
    try:
        ready = {side: _expect(conn, side, "ready", procs) for side, (conn, _) in pipes.items()}
        peers = {msg[1]: ("127.0.0.1", msg[2]) for msg in ready.values()}
        for conn, _ in pipes.values():
            conn.send(peers)
        _expect(p_conn, "P", "admitted", procs)
        d_conn.send("warm")
        _expect(d_conn, "D", "warm", procs)
        p_conn.send("go")
        d_conn.send("go")
        d = _expect(d_conn, "D", "ok", procs)[1]
        p_conn.send("stop")
        p = _expect(p_conn, "P", "ok", procs[:1])[1]  # D has finished and may have exited
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    poster = p if plan.op == "WRITE" else d
    return {
        "wall_s": d["wall_s"],
        "latency_s": d["latency_s"],
        "cpu_s": poster["cpu_s"],
        "verified": d["verified"],
        "descriptors": poster["descriptors"],
        "fabric_descriptors": poster["fabric_descriptors"],
        "idle_cpu_per_s": {"P": p["idle_cpu_per_s"], "D": d["idle_cpu_per_s"]},
        "hops_s": handoff_hops(
            plan.mode, d["admitted"], {"P": p["entered"], "D": d["entered"]}, d["reported"]
        ),
    }


def handoff_hops(
    mode: str,
    admitted: dict[str, float],
    entered: dict[str, dict[str, dict[str, float]]],
    reported: dict[str, float],
) -> dict[str, list[float]]:
    """Each hop's seconds (`HOPS[mode]`), one per request, from when D admitted each request,
    when each side's trace entered each state or took each event and when D reported it (all
    `time.monotonic`: one clock for every process of a host). A point a request never reached
    ends no hop of it."""
    hops: dict[str, list[float]] = {name: [] for name, _, _ in HOPS[mode]}
    for key, start in admitted.items():
        before = start
        for name, side, point in HOPS[mode]:
            at = reported.get(key) if point == "reported" else entered[side].get(key, {}).get(point)
            if at is not None:
                hops[name].append(at - before)
                before = at
    return hops


def _expect(conn: Connection, who: str, what: str, procs: Sequence[BaseProcess]) -> Any:
    msg = recv_bounded(conn, who, procs)
    if msg[0] != what:
        raise RuntimeError(f"bench engine {who}: {msg[1] if msg[0] == 'error' else msg!r}")
    return msg
