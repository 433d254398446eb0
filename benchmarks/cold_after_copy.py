"""How much slower the engine's own steps run right after a large copy than with warm caches.

    .venv/bin/python benchmarks/cold_after_copy.py [--mib 1 8 32 128] [--trials 40] [--json]

On one host UCX copies a transfer's bytes inside the poster's `transfer` call (CMA), on the
thread that then runs the engine's next steps: the request's completion, the next request's
grant and rows. A copy of many MiB evicts the caches those steps would find warm. This times
three of them, each alone (warm: run twice untimed, then timed) and right after a numpy copy of
`--mib` MiB, and reports medians in µs and the cold/warm ratio:

* `rows`: `Route.rows` of a 32 MiB request (64 regions x 32 blocks of 16 KiB, 2,048 rows);
* `core`: one request's whole lifecycle through a `Producer` and a `Consumer` back to back;
* `engine`: the same through two `Engine`s on `SimFabric`.

docs/performance.md has a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from itertools import count

import numpy as np

from kvfsm.cli.bench._control import core_wave, engine_wave, make_engines
from kvfsm.core import Consumer, CoreConfig, Identity, Producer
from kvfsm.layout import KvGeometry
from kvfsm.runtime._routes import plan_route

_GEOMETRY = KvGeometry(
    num_layers=64, num_kv_heads=1, head_dim=256, dtype_bytes=2, block_size=16, num_blocks=1024,
    mla=True,
)  # fmt: skip


def _steps() -> dict[str, Callable[[], object]]:
    route = plan_route(_GEOMETRY, _GEOMETRY, local_is_p=False)
    local, remote = np.arange(100, 132, dtype=np.int32), np.arange(500, 532, dtype=np.int32)
    config = CoreConfig(trace=True)  # as in production
    p, d = Producer(Identity("P"), "pull", config), Consumer(Identity("D"), "pull", config)
    ep, ed, net = make_engines("pull", 1)
    waves = count()
    return {
        "rows": lambda: route.rows(local, remote),
        "core": lambda: core_wave("pull", 1, p, d, next(waves)),
        "engine": lambda: engine_wave("pull", 1, ep, ed, net, next(waves)),
    }


def _time(step: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e6


def measure(mib: list[int], trials: int) -> dict[str, dict[str, float]]:
    """Median µs of each step warm and after a copy of each size."""
    steps = _steps()
    buffers = {m: (np.ones(m << 20, np.uint8), np.empty(m << 20, np.uint8)) for m in mib}
    for src, dst in buffers.values():
        np.copyto(dst, src)  # resident before timing
    out: dict[str, dict[str, float]] = {}
    for name, step in steps.items():
        warm: list[float] = []
        cold: dict[int, list[float]] = {m: [] for m in mib}
        for m, (src, dst) in buffers.items():  # one size at a time: each copy alone before it
            for _ in range(trials):
                step()
                step()
                warm.append(_time(step))
                np.copyto(dst, src)
                cold[m].append(_time(step))
        out[name] = {"warm_us": statistics.median(warm)} | {
            f"after_{m}mib_us": statistics.median(cold[m]) for m in mib
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = measure(args.mib, args.trials)
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print(f"{'step':8} {'warm µs':>9} " + " ".join(f"{f'{m} MiB copy':>16}" for m in args.mib))
    for name, row in figures.items():
        warm = row["warm_us"]
        cells = (f"{row[f'after_{m}mib_us']:7.1f} ({row[f'after_{m}mib_us'] / warm:4.1f}x)"
                 for m in args.mib)  # fmt: skip
        print(f"{name:8} {warm:9.1f} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
