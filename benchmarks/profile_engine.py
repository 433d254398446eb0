"""Where the posting engine's CPU goes: `kvfsm bench`'s engine variant alone, to profile.

    py-spy record --subprocesses -r 2000 -f raw -o prof.txt -- \\
        .venv/bin/python benchmarks/profile_engine.py run push
    .venv/bin/python benchmarks/profile_engine.py summarize prof.txt push

`run` moves `--requests` requests of 1 MiB (16 KiB blocks, 16 per request, 4 regions,
contiguous; `--regions 32` makes them 8 MiB) through P and D engines in processes of their own, exactly as `kvfsm bench` runs
its variant (b), and prints its figures. `summarize` groups the posting rank's busy samples
(P in push, D in pull; its loop thread, sleeps left out) into the engine's own work and the NIXL
calls a raw loop makes too (docs/performance-history.md has a table of one run).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from kvfsm.bench import BenchPlan, plan_requests, run_engine_variant

_BLOCK_BYTES, _BLOCKS = 16384, 16

# The first group a sample's stack contains names it; the rest is the engine's Python.
_GROUPS = {
    "nixl_agent.transfer ": "NIXL transfer (post), as in the raw loop",
    "nixl_agent.make_prepped_xfer ": "NIXL make_prepped_xfer, as in the raw loop",
    "nixl_agent.check_xfer_state ": "NIXL check, as in the raw loop",
    "nixl_agent.release_xfer_handle ": "NIXL release, as in the raw loop",
    "nixl_agent.get_xfer_telemetry ": "NIXL telemetry",
    "nixl_agent.get_new_notifs ": "NIXL notification drain",
    "nixl_agent.send_notif ": "NIXL send_notif",
    "Side.handle ": "the core (Side.handle)",
    "Route.rows ": "the request's rows (Route.rows)",
}


def contiguous_plan(mode: str, requests: int, regions: int) -> BenchPlan:
    """`requests` requests of 16 blocks of 16 KiB in each of `regions` regions, contiguous
    (`regions=4`: 1 MiB requests), as the bench's defaults lay them out."""
    src, dst = plan_requests(
        requests=requests,
        blocks=_BLOCKS,
        num_blocks=requests * _BLOCKS,
        allocation="contiguous",
        seed=0,
    )
    return BenchPlan(
        block_bytes=_BLOCK_BYTES,
        num_blocks=requests * _BLOCKS,
        regions=regions,
        op="WRITE" if mode == "push" else "READ",
        src=src,
        dst=dst,
    )


def run(mode: str, requests: int, regions: int) -> None:
    """Run the engine variant once and print its figures (latencies left out)."""
    figures = run_engine_variant(contiguous_plan(mode, requests, regions), coalesce=False)
    print(json.dumps({k: v for k, v in figures.items() if k != "latency_s"}))


def summarize(path: str, mode: str) -> None:
    """Print the posting rank's busy samples by group from py-spy's raw output."""
    # The driver spawns P first, then D: the posting rank is the first child in push.
    children: list[str] = []
    samples: list[tuple[list[str], int]] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        if len(frames) < 2 or "spawn_main" not in frames[1]:
            continue
        if frames[1] not in children:
            children.append(frames[1])
        samples.append((frames, int(n)))
    children.sort(key=lambda f: int(f.split()[1].rstrip(":").split(":")[0]))
    poster = children[0 if mode == "push" else 1]
    groups: Counter[str] = Counter()
    for frames, count in samples:
        on_loop = any(f.startswith("EngineLoop._run ") for f in frames)
        if frames[1] != poster or not on_loop or frames[-1].startswith("Condition.wait "):
            continue
        found = (g for key, g in _GROUPS.items() if any(f.startswith(key) for f in frames))
        groups[next(found, "the engine's and the loop's other Python")] += count
    busy = sum(groups.values())
    print(f"{busy} busy samples of the posting rank's loop thread")
    for group, count in groups.most_common():
        print(f"{100 * count / busy:6.1f}%  {group}")


def main() -> None:
    """`run` the workload or `summarize` a profile of it."""
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("mode", choices=["push", "pull"])
    r.add_argument("--requests", type=int, default=512)
    r.add_argument("--regions", type=int, default=4, help="KV regions (4: 1 MiB requests)")
    s = sub.add_parser("summarize")
    s.add_argument("path")
    s.add_argument("mode", choices=["push", "pull"])
    args = parser.parse_args()
    if args.what == "run":
        run(args.mode, args.requests, args.regions)
    else:
        summarize(args.path, args.mode)


if __name__ == "__main__":
    main()
