"""Would the engine's bookkeeping on a second thread overlap UCX's copies? (issue 5)

    .venv/bin/python benchmarks/bookkeeping_thread.py [--op READ|WRITE] [--regions 4]
        [--blocks-per-request 16] [--requests 64] [--work-us 120] [--rounds 5] [--json]

The engine's per-request Python (~100-140 µs: the core, the rows, messages, outputs) runs on
the thread that posts, and on one host UCX copies inside the post, so the two add up. The
binding releases the GIL while it copies, so a second thread could in principle do that work
meanwhile while one thread alone still calls NIXL. This measures the idea without the engine:
`kvfsm bench`'s raw loop (a2: the engine's agent settings, prepared per-block rows, 4 in
flight) against the same loop with `--work-us` of pure-Python work per request (a fixed number
of dict updates, calibrated once for all variants, half before the post and half after the
completion)

* **inline**, on the posting thread, as the engine does it, and
* **thread**, on a helper thread that admits requests and takes their completions while the
  posting thread only posts and checks (one thread still owns NIXL), at GIL switch intervals
  of 5 ms (Python's default), 250 µs (kvfsm's vLLM worker) and 50 µs.

Rounds run every variant in turn; each variant's median GB/s and its ratio to the plain loop
are reported, with the µs per request spent inside NIXL's `transfer` (the copy, and taking the
GIL back), in the work, and in both at once (how much the threads did overlap).
docs/performance.md has runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # inherited by the spawned processes

from kvfsm.cli.bench._raw import BenchPlan, RawInitiator, plan_requests, run_pair

_VARIANTS: tuple[tuple[str, float], ...] = (
    ("plain", 0.005),
    ("inline", 0.005),
    ("thread", 0.005),
    ("thread", 0.00025),
    ("thread", 0.00005),
)
_WAIT_S = 0.001  # a bound on each wait for the other thread, not a poll interval
_POLL_S = 20e-6  # the engine loop's poll interval while transfers are in flight


def _work(units: int) -> None:
    """Pure-Python work of a fixed size (dict updates, like the engine's bookkeeping)."""
    d: dict[int, tuple[int, int]] = {}
    for i in range(units):
        d[i & 63] = (i, i + 1)


def _units_per_us() -> float:
    best = float("inf")
    for _ in range(7):  # the fastest of a few: the work's cost when nothing else interferes
        t0 = time.perf_counter()
        _work(50_000)
        best = min(best, time.perf_counter() - t0)
    return 50_000 / (best * 1e6)


class _Timed:
    """Intervals spent in one kind of step (each kind runs on one thread, so they are ordered)."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def work(self, units: int) -> None:
        t0 = time.perf_counter()
        _work(units)
        self.spans.append((t0, time.perf_counter()))

    def total(self) -> float:
        return sum(b - a for a, b in self.spans)

    def overlap(self, other: _Timed) -> float:
        """Time during which a span of each was open (both lists in time order)."""
        shared, i, j = 0.0, 0, 0
        while i < len(self.spans) and j < len(other.spans):
            (a, b), (c, d) = self.spans[i], other.spans[j]
            shared += max(0.0, min(b, d) - max(a, c))
            if b < d:
                i += 1
            else:
                j += 1
        return shared


class _Poster(RawInitiator):
    """The thread that owns NIXL in this measurement (a2's settings): posts transfers, checks
    them, and times each post (inside NIXL's transfer: where UCX copies)."""

    def __init__(self, plan: BenchPlan, remote: tuple[bytes, int]) -> None:
        super().__init__(plan, "raw", remote)
        self.pending: dict[int, int] = {}
        self.posts = _Timed()

    def post(self, i: int) -> None:
        h = self.xfer(i)
        t0 = time.perf_counter()
        self.fabric.transfer(h)
        self.posts.spans.append((t0, time.perf_counter()))
        self.pending[h] = i

    def finished(self) -> list[int]:
        done = []
        for h, i in list(self.pending.items()):
            state = self.fabric.check_xfer_state(h)
            if state == "ERR":
                raise RuntimeError("a transfer ended in ERR")
            if state == "DONE":
                self.fabric.xfer_telemetry(h)
                self.fabric.release_xfer_handle(h)
                del self.pending[h]
                done.append(i)
        return done


def _inline(poster: _Poster, n: int, units: int, timed: _Timed) -> None:
    admitted = done = 0
    while done < n:
        while admitted < n and len(poster.pending) < poster.plan.inflight:
            if units:
                timed.work(units)
            poster.post(admitted)
            admitted += 1
        for _ in poster.finished():
            if units:
                timed.work(units)
            done += 1


def _threaded(poster: _Poster, n: int, units: int, timed: _Timed) -> None:
    ready: deque[int] = deque()
    completions: deque[int] = deque()
    to_poster, to_helper = threading.Event(), threading.Event()
    done = [0]

    def helper() -> None:  # admits requests and takes completions; never calls NIXL
        admitted = 0
        while done[0] < n:
            to_helper.clear()  # before looking: a later set() ends the wait below
            busy = False
            while admitted < n and admitted - done[0] < poster.plan.inflight:
                timed.work(units)
                ready.append(admitted)
                admitted += 1
                to_poster.set()
                time.sleep(0)  # hand the GIL to the poster at once if it waits for it
                busy = True
            while completions:
                completions.popleft()
                timed.work(units)
                done[0] += 1
                busy = True
                time.sleep(0)
            if not busy:
                to_helper.wait(_WAIT_S)
        to_poster.set()

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    while done[0] < n:
        to_poster.clear()
        finished = False
        while True:  # each completion to the helper as soon as its post returns
            now = poster.finished()
            if now:
                completions.extend(now)
                to_helper.set()
                finished = True
            if not ready:
                break
            poster.post(ready.popleft())
        if not finished:
            # Leave the GIL to the helper: not at all while it must post, briefly while its
            # transfers are in flight (the engine loop's 20 µs poll), else until woken.
            to_poster.wait(_POLL_S if poster.pending else _WAIT_S)
    thread.join()


def _initiator(
    plan: BenchPlan, variant: str, switch_s: float, units: int, remote: tuple[bytes, int]
) -> dict[str, Any]:
    sys.setswitchinterval(switch_s)
    poster = _Poster(plan, remote)
    poster.post(0)  # warm-up: UCX wires its lanes up on the first transfers
    while not poster.finished():
        pass
    poster.posts.spans.clear()
    n, timed = len(plan.src), _Timed()
    t0 = time.perf_counter()
    if variant == "thread":
        _threaded(poster, n, units, timed)
    else:
        _inline(poster, n, units if variant == "inline" else 0, timed)
    wall = time.perf_counter() - t0
    return {
        "gbps": plan.bytes_per_request * n / wall / 1e9,
        "post_us": 1e6 * poster.posts.total() / n,
        "work_us": 1e6 * timed.total() / n,
        "overlap_us": 1e6 * poster.posts.overlap(timed) / n,
        "verified": poster.close(),
    }


def run_once(plan: BenchPlan, variant: str, switch_s: float, units: int) -> dict[str, float]:
    """One variant's GB/s and its µs per request inside the posts, in the work and in both at
    once; target and initiator in processes of their own, every byte checked."""
    args = (plan, variant, switch_s, units)
    figures = run_pair(plan, "raw", _initiator, args, f"bookkeeping, {variant}")
    if not figures.pop("verified"):
        raise RuntimeError(f"bookkeeping bench ({variant}): bytes differ")
    return figures


def measure(plan: BenchPlan, work_us: float, rounds: int) -> list[dict[str, Any]]:
    """Each variant over interleaved rounds: the median GB/s, every run's, the ratio to plain,
    and the medians of µs per request in the posts, in the work and in both at once."""
    units = int(work_us / 2 * _units_per_us())  # once, so that every variant does the same work
    runs: dict[tuple[str, float], list[dict[str, float]]] = {v: [] for v in _VARIANTS}
    for _ in range(rounds):
        for variant, switch_s in _VARIANTS:
            runs[variant, switch_s].append(run_once(plan, variant, switch_s, units))
    plain = statistics.median(r["gbps"] for r in runs[_VARIANTS[0]])
    rows = []
    for (name, switch_s), results in runs.items():
        row: dict[str, Any] = {
            "variant": name if name != "thread" else f"thread, switch {switch_s * 1e6:.0f} us"
        }
        row |= {k: statistics.median(r[k] for r in results) for k in results[0]}
        row |= {"gbps_runs": [r["gbps"] for r in results], "ratio_to_plain": row["gbps"] / plain}
        rows.append(row)
    return rows


def main() -> None:
    """Parse the arguments, measure, print a table (or `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--op", choices=["READ", "WRITE"], default="READ")
    parser.add_argument("--regions", type=int, default=4)
    parser.add_argument("--blocks-per-request", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--work-us", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    blocks = args.requests * args.blocks_per_request
    src, dst = plan_requests(
        requests=args.requests, blocks=args.blocks_per_request, num_blocks=blocks,
        allocation="contiguous", seed=0,
    )  # fmt: skip
    plan = BenchPlan(
        block_bytes=16 << 10, num_blocks=blocks, regions=args.regions, op=args.op,
        src=src, dst=dst,
    )  # fmt: skip
    rows = measure(plan, args.work_us, args.rounds)
    if args.json:
        print(json.dumps({"mib_per_request": plan.bytes_per_request / (1 << 20), "rows": rows}))
        return
    print(f"{args.op}, {plan.bytes_per_request / (1 << 20):g} MiB requests, "
          f"{args.work_us:g} us of Python per request, median of {args.rounds} rounds")  # fmt: skip
    print(f"{'variant':<26} {'GB/s':>6} {'/plain':>7} {'post us':>8} {'work us':>8} {'both us':>8}")
    for r in rows:
        print(
            f"{r['variant']:<26} {r['gbps']:>6.2f} {r['ratio_to_plain']:>7.2f} "
            f"{r['post_us']:>8.0f} {r['work_us']:>8.0f} {r['overlap_us']:>8.0f}"
        )


if __name__ == "__main__":
    main()
