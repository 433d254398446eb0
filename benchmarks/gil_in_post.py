"""Does NIXL's Python `transfer` let other Python threads run while UCX moves the bytes?

    .venv/bin/python benchmarks/gil_in_post.py [--op READ|WRITE] [--mib 8] [--posts 32] [--json]

A target process registers a buffer and progresses UCX; this process posts `--posts` transfers
of `--mib` MiB (one descriptor each, the engine's agent settings) while a second Python thread
counts as fast as it can. For each post it records how long `transfer` took and how far the
counter moved meanwhile, against the counter's rate while the posting thread sleeps. A rate
near 0 during posts means the binding holds the GIL for the whole copy (UCX over shared memory
or CMA on one host copies inside the post): every other thread of the process, vLLM's model
runner included, waits that long. docs/performance.md has a run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from multiprocessing.connection import Connection

import numpy as np

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # inherited by the spawned target


def _target(nbytes: int, conn: Connection) -> None:
    from kvfsm.fabric import NixlFabric

    fabric = NixlFabric("gil-target", progress_thread=False)
    buf = np.ones(nbytes, dtype=np.uint8)
    handle = fabric.register_memory(buf)
    conn.send((fabric.get_agent_metadata(), int(buf.ctypes.data)))
    while not conn.poll(200e-6):
        fabric.get_new_notifs()  # progress UCX, as an engine's loop does
    conn.recv()
    fabric.deregister_memory(handle)
    fabric.close()


class _Spinner:
    """A Python thread that counts while it holds the GIL."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop:
            self.count += 1

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


def measure(op: str, mib: int, posts: int) -> dict[str, str | float]:
    """Posts of `mib` MiB: the median post time and the spinner's rate during posts and sleeps."""
    from kvfsm.fabric import NixlFabric

    nbytes = mib << 20
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(nbytes, child), daemon=True)
    proc.start()
    fabric = NixlFabric("gil-initiator", progress_thread=False)
    try:
        metadata, far_addr = conn.recv()
        buf = np.zeros(nbytes, dtype=np.uint8)
        mem = fabric.register_memory(buf)
        peer = fabric.add_remote_agent(metadata)
        local = np.array([[int(buf.ctypes.data), nbytes, 0]], dtype=np.int64)
        remote = np.array([[far_addr, nbytes, 0]], dtype=np.int64)
        spinner = _Spinner()
        post_s: list[float] = []
        post_rate: list[float] = []
        sleep_rate: list[float] = []
        for i in range(posts + 1):  # the first post wires UCX up: not counted
            handle = fabric.make_xfer(op, local, peer, remote, b"")  # type: ignore[arg-type]
            c0, t0 = spinner.count, time.perf_counter()
            state = fabric.transfer(handle)
            t1, c1 = time.perf_counter(), spinner.count
            while state == "PROC":
                state = fabric.check_xfer_state(handle)
            fabric.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer ended {state}")
            c2, t2 = spinner.count, time.perf_counter()
            time.sleep(t1 - t0)  # the spinner alone for as long as the post took
            c3, t3 = spinner.count, time.perf_counter()
            if i:
                post_s.append(t1 - t0)
                post_rate.append((c1 - c0) / (t1 - t0))
                sleep_rate.append((c3 - c2) / (t3 - t2))
        spinner.stop()
        fabric.remove_remote_agent(peer)
        fabric.deregister_memory(mem)
    finally:
        fabric.close()
        conn.send("stop")
        proc.join(10)
    free = statistics.median(sleep_rate)
    return {
        "op": op, "mib": mib, "posts": posts,
        "post_us_p50": 1e6 * statistics.median(post_s),
        "spin_per_ms_during_post": statistics.median(post_rate) / 1e3,
        "spin_per_ms_during_sleep": free / 1e3,
        "other_threads_ran_fraction": statistics.median(post_rate) / free if free else 0.0,
    }  # fmt: skip


def main() -> None:
    """Parse the arguments, measure, print a line (or `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--op", choices=["READ", "WRITE"], default="READ")
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--posts", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.op, args.mib, args.posts)
    if args.json:
        print(json.dumps(result))
        return
    r = {k: v for k, v in result.items() if isinstance(v, float)}
    print(
        f"{args.op} {args.mib} MiB: transfer() p50 {r['post_us_p50']:.0f} us; another Python"
        f" thread ran {100 * r['other_threads_ran_fraction']:.0f}% of its free rate meanwhile"
        f" ({r['spin_per_ms_during_post']:.0f} vs {r['spin_per_ms_during_sleep']:.0f}"
        " iterations/ms)"
    )


if __name__ == "__main__":
    main()
