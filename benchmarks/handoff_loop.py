"""`.venv/bin/python benchmarks/handoff_loop.py`: hand-off latency with kvfsm's event-driven `EngineLoop`
against a fixed 1 ms polling loop around the same engine.

vLLM's NIXL connector moves KV on a writer thread that, while it has work, wakes every 1 ms,
takes what the engine queued for it, and polls NIXL. kvfsm's `EngineLoop` wakes when an event
is submitted, a handshake ends or a deadline falls due, and polls NIXL with a back-off from
20 us while transfers are live. Both drive the same `Engine` here: P and D are the rank
processes of `kvfsm demo --fabric nixl` (real NIXL agents over DRAM, handshakes over ZMQ on
loopback, every byte D receives checked), once with each loop. Requests go one at a time, in
the order a disaggregating proxy makes: P's prefill ends, then D is admitted. A request's
hand-off runs from P submitting `PrefillFinished` to D's `ReportReceived` (the host's monotonic
clock, shared by both processes); the first requests (handshake, connection set-up) are left
out.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Literal, TypeVar

import numpy as np

from kvfsm.cli.demo import Driver, Tally
from kvfsm.cli.render import figures_table
from kvfsm.core import Event, Mode
from kvfsm.fabric import UCX_ERROR_HANDLING_DEFAULT, UcxErrorHandling
from kvfsm.harness import RankProcesses, RankSpec, rank_main
from kvfsm.layout import DTYPES, model_geometry
from kvfsm.runtime import CallerOutput, Engine
from kvfsm.sidechannel import compat_hash
from kvfsm.wire import WIRE_VERSION

__all__ = ["LOOPS", "Poll1msLoop", "bench_handoff", "run_loop"]

T = TypeVar("T")
LoopKind = Literal["event", "poll1ms"]
LOOPS: tuple[LoopKind, ...] = ("event", "poll1ms")
_WARMUP = 3  # requests left out of the figures: the first one pays the handshake
_BLOCK_SIZE = 16


class Poll1msLoop:
    """The comparison: a thread that sleeps `interval_s`, then runs what was submitted and
    polls the engine, whatever happens in between (the shape of vLLM's writer thread). It has
    `EngineLoop`'s interface so that a rank can run either."""

    def __init__(
        self,
        engine: Engine,
        on_output: Callable[[CallerOutput], None],
        interval_s: float = 1e-3,
    ) -> None:
        self.engine, self.on_output, self.interval_s = engine, on_output, interval_s
        self.errors: list[str] = []
        self._inbox: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poll1ms-loop", daemon=True)

    def start(self) -> Poll1msLoop:
        """Start the thread."""
        self._thread.start()
        return self

    def submit(self, event: Event) -> Future[None]:
        """Queue `event` for the next tick."""
        return self.call(lambda engine: engine.submit(event))

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Queue `fn(engine)` for the next tick."""
        future: Future[T] = Future()
        self._inbox.put((fn, future))
        return future

    def wake(self) -> None:
        """Ignored: this loop wakes on its timer only."""

    def stop(self, drain_s: float = 0.0, timeout: float | None = 30.0) -> None:
        """Stop the thread (it closes the engine)."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                while not self._inbox.empty():
                    fn, future = self._inbox.get()
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as exc:  # the caller's protocol error, as EngineLoop does
                        future.set_exception(exc)
                try:
                    self.engine.poll()
                except Exception as exc:  # keep serving, say what happened
                    self.errors.append(f"poll: {exc!r}")
                for output in self.engine.take_outputs():
                    try:
                        self.on_output(output)
                    except Exception as exc:
                        self.errors.append(f"on_output: {exc!r}")
        finally:
            self.engine.close()


def _poll1ms_rank_main(spec: RankSpec, conn: Connection) -> None:
    """A demo rank process whose engine runs on a `Poll1msLoop` (a spawn target)."""
    rank_main(spec, conn, make_loop=Poll1msLoop)


def run_loop(
    loop: LoopKind,
    mode: Mode,
    requests: int,
    *,
    model: str = "llama3-8b",
    max_blocks: int = 4,
    ucx_error_handling: UcxErrorHandling = UCX_ERROR_HANDLING_DEFAULT,
    seed: int = 0,
) -> Tally:
    """Run `requests` requests one at a time through a P and a D rank process driven by
    `loop`; what the ranks reported (hand-off times in `handoff_ms`)."""
    geometry = model_geometry(
        model, tp_size=1, block_size=_BLOCK_SIZE, memory_mib=max(64, 4 * max_blocks * 2)
    )
    hash_ = compat_hash(
        wire_version=WIRE_VERSION, mode=mode, model=model, dtype=DTYPES[model], geometry=geometry
    )
    main = rank_main if loop == "event" else _poll1ms_rank_main
    ranks = RankProcesses()
    for side in ("P", "D"):
        ranks.start(
            RankSpec(
                side,
                mode,
                geometry.for_rank(0),
                1,
                _BLOCK_SIZE,
                hash_,
                ucx_error_handling=ucx_error_handling,
            ),
            main,
        )
    tally = Tally()
    try:
        ranks.connect(ranks.await_ready())
        driver = Driver(seed, {"P": geometry, "D": geometry}, max_blocks, ranks, tally, 0)
        _one_at_a_time(driver, requests, ranks)
    finally:
        tally.take_finals(ranks.stop())
    return tally


def _one_at_a_time(driver: Driver, requests: int, ranks: RankProcesses) -> None:
    """Admit the next request once the previous one ended on both sides."""
    deadline = time.monotonic() + max(120.0, requests * 0.5)
    while driver.done < requests:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{requests - driver.done} requests did not end in time")
        driver.admit(driver.done + 1)
        for agent, conn in ranks.readable(1.0):
            driver.take(agent, conn.recv())
        dead = ranks.dead()
        if dead:
            raise RuntimeError(f"rank processes died: {dead}; errors: {driver.tally.errors[:5]}")


def bench_handoff(
    mode: str = "pull",
    requests: int = 300,
    *,
    model: str = "llama3-8b",
    max_blocks: int = 4,
    ucx_error_handling: UcxErrorHandling = UCX_ERROR_HANDLING_DEFAULT,
) -> dict[str, Any]:
    """Hand-off p50/p99 with each loop, their ratio, and what was received and checked."""
    if mode not in ("pull", "push"):
        raise ValueError(f"mode must be pull or push, not {mode!r}")
    out: dict[str, Any] = {
        "mode": mode,
        "requests": requests,
        "model": model,
        "max_blocks": max_blocks,
        "ucx_error_handling": ucx_error_handling,
        "warmup_requests_left_out": _WARMUP,
    }
    transfer_mode: Mode = "push" if mode == "push" else "pull"
    for loop in LOOPS:
        tally = run_loop(
            loop,
            transfer_mode,
            requests,
            model=model,
            max_blocks=max_blocks,
            ucx_error_handling=ucx_error_handling,
        )
        ms = tally.handoff_ms[_WARMUP:] or tally.handoff_ms
        out |= {
            f"handoff_{loop}_ms_p50": _round(np.percentile(ms, 50)) if ms else None,
            f"handoff_{loop}_ms_p99": _round(np.percentile(ms, 99)) if ms else None,
            f"received_{loop}": tally.received,
            f"done_{loop}": tally.states["D:done"],
            f"bytes_checked_{loop}": tally.compared,
            f"bytes_wrong_{loop}": tally.wrong,
            f"errors_{loop}": tally.errors[:5],
        }
    event, poll = out["handoff_event_ms_p50"], out["handoff_poll1ms_ms_p50"]
    out["ratio_event_poll1ms"] = round(event / poll, 3) if event and poll else None
    return out


def _round(x: Any) -> float:
    return round(float(x), 3)


def main(argv: list[str] | None = None) -> None:
    """Print the figures (as JSON with `--json`)."""
    parser = argparse.ArgumentParser(prog="benchmarks/handoff_loop.py", description=__doc__)
    parser.add_argument("--mode", choices=["pull", "push"], default="pull")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--max-blocks", type=int, default=4)
    parser.add_argument("--ucx-error-handling", choices=["peer", "none"], default=None)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    figures = bench_handoff(
        args.mode,
        args.requests,
        model=args.model,
        max_blocks=args.max_blocks,
        ucx_error_handling=args.ucx_error_handling or UCX_ERROR_HANDLING_DEFAULT,
    )
    figures_table("hand-off: event-driven loop vs 1 ms polling", figures, as_json=args.json)


if __name__ == "__main__":
    main()
