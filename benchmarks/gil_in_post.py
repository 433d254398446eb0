"""What NIXL's Python `transfer` does to the process's other Python threads while UCX copies.

    .venv/bin/python benchmarks/gil_in_post.py [--op READ|WRITE] [--mib 8] [--posts 16] [--json]

The raw target of `kvfsm bench` registers a buffer in a process of its own and progresses UCX;
this process posts `--posts` transfers of `--mib` MiB (one descriptor each, the engine's agent
settings), first alone, then with a second Python thread that is always busy (as vLLM's model
runner is), under GIL switch intervals of 5 ms (Python's default), 250 µs (kvfsm's vLLM
worker) and 50 µs. For each it reports the post's median time and the median share of the post
during which the busy thread ran. On one host UCX copies inside the post (shared memory, CMA): the binding releases the GIL
for the copy, so the busy thread runs meanwhile, and the poster then waits up to a switch
interval to take the GIL back. docs/performance.md has a run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Any, Literal

import numpy as np

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # inherited by the spawned target
_PAUSE_S = 0.01  # between posts: the busy thread runs alone


class _Busy:
    """A Python thread that notes the time whenever it holds the GIL."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        note, now = self.stamps.append, time.perf_counter
        while not self._stop:
            note(now())
            if len(self.stamps) > 1_000_000:
                del self.stamps[:500_000]  # bounded: only the latest post's window is read

    def share_of(self, t0: float, t1: float) -> float:
        """The share of [t0, t1] between this thread's first and last note in it."""
        inside = [t for t in self.stamps[-200_000:] if t0 < t < t1]
        return (inside[-1] - inside[0]) / (t1 - t0) if len(inside) > 1 else 0.0

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


def _posts(fabric: Any, xfer: tuple[Any, ...], n: int, busy: _Busy | None) -> dict[str, float]:
    post_s: list[float] = []
    shares: list[float] = []
    for i in range(n + 1):  # the first post wires UCX up (or follows a change): not counted
        handle = fabric.make_xfer(*xfer)
        t0 = time.perf_counter()
        state = fabric.transfer(handle)
        t1 = time.perf_counter()
        while state == "PROC":
            state = fabric.check_xfer_state(handle)
        fabric.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"transfer ended {state}")
        if i:
            post_s.append(t1 - t0)
            shares.append(busy.share_of(t0, t1) if busy else 0.0)
        time.sleep(_PAUSE_S)
    return {
        "post_us_p50": 1e6 * statistics.median(post_s),
        "busy_ran_share": statistics.median(shares),
    }


def measure(op: Literal["READ", "WRITE"], mib: int, posts: int) -> list[dict[str, Any]]:
    """One row per setting: alone, then beside a busy thread at each switch interval."""
    from kvfsm.cli.bench._raw import BenchPlan, serve_target
    from kvfsm.fabric import NixlFabric

    nbytes = mib << 20
    # One block of the whole size in one region: the bench's target serves it.
    plan = BenchPlan(block_bytes=nbytes, num_blocks=1, regions=1, op=op, src=[[0]], dst=[[0]])
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=serve_target, args=(plan, "raw", child), daemon=True)
    proc.start()
    fabric = NixlFabric("gil-initiator", progress_thread=False)
    rows: list[dict[str, Any]] = []
    interval = sys.getswitchinterval()
    try:
        metadata, far_addr = conn.recv()
        buf = np.zeros(nbytes, dtype=np.uint8)
        mem = fabric.register_memory(buf)
        peer = fabric.add_remote_agent(metadata)
        local = np.array([[int(buf.ctypes.data), nbytes, 0]], dtype=np.int64)
        remote = np.array([[far_addr, nbytes, 0]], dtype=np.int64)
        xfer = (op, local, peer, remote, b"")
        rows.append({"setting": "alone"} | _posts(fabric, xfer, posts, None))
        busy = _Busy()
        for switch_us in (5000, 250, 50):  # Python's default, the vLLM worker's, short
            sys.setswitchinterval(switch_us / 1e6)
            row = {"setting": f"busy thread, switch {switch_us} us"}
            rows.append(row | _posts(fabric, xfer, posts, busy))
        busy.stop()
        fabric.remove_remote_agent(peer)
        fabric.deregister_memory(mem)
    finally:
        sys.setswitchinterval(interval)
        fabric.close()
        conn.send("done")
        conn.recv()  # the target's byte check, not needed here
        proc.join(10)
    return [{"op": op, "mib": mib, "posts": posts} | row for row in rows]


def main() -> None:
    """Parse the arguments, measure, print a line (or `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--op", choices=["READ", "WRITE"], default="READ")
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--posts", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(args.op, args.mib, args.posts)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{args.op} of {args.mib} MiB, {args.posts} posts each")
    print(f"{'setting':<28} {'transfer() p50 us':>18} {'busy thread ran':>16}")
    for r in rows:
        print(f"{r['setting']:<28} {r['post_us_p50']:>18.0f} {100 * r['busy_ran_share']:>15.0f}%")


if __name__ == "__main__":
    main()
