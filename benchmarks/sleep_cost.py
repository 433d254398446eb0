"""What one short sleep costs the sleeping thread in CPU, the way `EngineLoop` sleeps between
polls (a `threading.Condition` wait with a timeout) and as `time.sleep`.

    .venv/bin/python benchmarks/sleep_cost.py [--timeouts-us 20 100 1000] [--json]

With Linux's timer slack set to 1 µs, as the loop's thread does. For each timeout it reports
the wall time and the thread's CPU time (CLOCK_THREAD_CPUTIME_ID) per sleep. On this machine's
virtual CPUs a sleep cost the thread ~20-30 µs of CPU whatever the timeout (18-50 over four
runs), and a 20 µs timeout slept 44-53 µs (docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import sys
import threading
import time
from collections.abc import Callable

_PR_SET_TIMERSLACK = 29
_BUDGET_S = 0.3  # per timeout and kind of sleep


def _per_sleep(sleep: Callable[[float], object], timeout: float) -> tuple[float, float]:
    """Wall and thread-CPU microseconds per `sleep(timeout)`."""
    n = max(1, int(_BUDGET_S / max(timeout, 50e-6)))
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        sleep(timeout)
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    return wall / n * 1e6, cpu / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeouts-us", type=float, nargs="+", default=[20.0, 100.0, 1000.0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    cond = threading.Condition()

    def wait(timeout: float) -> None:
        with cond:
            cond.wait(timeout)

    rows = []
    for us in args.timeouts_us:
        wall_c, cpu_c = _per_sleep(wait, us * 1e-6)
        wall_s, cpu_s = _per_sleep(time.sleep, us * 1e-6)
        rows.append({
            "timeout_us": us, "condition_wall_us": round(wall_c, 1),
            "condition_cpu_us": round(cpu_c, 1), "sleep_wall_us": round(wall_s, 1),
            "sleep_cpu_us": round(cpu_s, 1),
        })  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"{'timeout µs':>10} | {'Condition.wait: wall':>20} {'CPU':>6} | {'time.sleep: wall':>16} {'CPU':>6}"
    )
    for r in rows:
        print(
            f"{r['timeout_us']:>10.0f} | {r['condition_wall_us']:>20.1f} "
            f"{r['condition_cpu_us']:>6.1f} | {r['sleep_wall_us']:>16.1f} {r['sleep_cpu_us']:>6.1f}"
        )


if __name__ == "__main__":
    main()
