"""`kvfsm bench`: transfers side by side on one geometry and one set of requests, P and D in
processes of their own, every byte checked: raw NIXL (vLLM's way and with the engine's
settings), the kvfsm engine (one row per block, and coalescing), memcpy; then the control
plane's CPU per request lifecycle at several numbers of requests in flight."""

from __future__ import annotations

import argparse
import json
import sys

from kvfsm.bench import (
    DEFAULT_VARIANTS,
    LAYOUTS,
    MEMORIES,
    VARIANTS,
    BenchOptions,
    run_bench,
    steps,
    unavailable,
)
from kvfsm.cli._parsing import Commands
from kvfsm.cli.render import bench_table, progress_bar

__all__ = ["BenchOptions", "add_command", "run_bench"]


def add_command(commands: Commands) -> None:
    """`kvfsm bench`: the engine side by side with raw NIXL and memcpy."""
    bench = commands.add_parser(
        "bench",
        help="throughput side by side: raw NIXL (vLLM's way, kvfsm's settings), the engine, memcpy",
    )
    bench.add_argument(
        "--mode", choices=["push", "pull"], default="push", help="push: WRITE; pull: READ"
    )
    bench.add_argument(
        "--allocation",
        choices=["contiguous", "fragmented", "realistic"],
        default="contiguous",
        help="how requests' blocks lie: runs, a shuffled free list, or an allocator after churn",
    )
    bench.add_argument(
        "--memory",
        choices=MEMORIES,
        default="dram",
        help="where both KV caches are: host memory, or one CUDA device's (registered as VRAM)",
    )
    bench.add_argument("--block-kib", type=int, default=16, help="KiB of one block in one region")
    bench.add_argument("--blocks", type=int, default=2048, help="blocks per region")
    bench.add_argument("--regions", type=int, default=4, help="regions (layers x K/V)")
    bench.add_argument("--requests", type=int, default=64, help="requests each variant moves")
    bench.add_argument(
        "--blocks-per-request", type=int, default=16, help="blocks of every region per request"
    )
    bench.add_argument(
        "--inflight",
        type=int,
        nargs="+",
        default=[4],
        help="transfers in flight at most; more than one: every variant at each (by_inflight)",
    )
    bench.add_argument("--seed", type=int, default=0, help="seed of the blocks and bytes")
    bench.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds of every variant, interleaved; each variant reports its median run",
    )
    bench.add_argument(
        "--ucx-error-handling",
        choices=["peer", "none"],
        default="peer",
        help="UCX error handling for kvfsm's variants (a1 keeps NIXL's default, peer)",
    )
    bench.add_argument(
        "--control-in-flight",
        type=int,
        nargs="+",
        default=[10, 100, 1000, 10000],
        help="requests in flight for the control-plane CPU figures",
    )
    bench.add_argument(
        "--control-total",
        type=int,
        default=10000,
        help="lifecycles per control-plane measurement (0 skips it)",
    )
    bench.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(DEFAULT_VARIANTS),
        help="which variants run (raw and engine always do: b/a2 is the headline)",
    )
    bench.add_argument(
        "--verify",
        action="store_true",
        help="also run the engine with verify=all (checksums on both sides; v/b is its cost)",
    )
    bench.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="LBHNC",
        help="vLLM's KV cache layout of both caches: BL* keep a block's pages of every layer"
        " together, and kvfsm moves such a block as one row (default: %(default)s)",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=_execute)


def _execute(args: argparse.Namespace) -> int:
    if reason := unavailable(args.memory):
        print(f"kvfsm bench: {reason}", file=sys.stderr)
        return 2
    try:
        options = BenchOptions(
            mode=args.mode,
            allocation=args.allocation,
            block_kib=args.block_kib,
            num_blocks=args.blocks,
            regions=args.regions,
            requests=args.requests,
            blocks_per_request=args.blocks_per_request,
            inflight=args.inflight[0],
            seed=args.seed,
            more_inflight=tuple(args.inflight[1:]),
            control_in_flight=tuple(args.control_in_flight),
            control_total=args.control_total,
            ucx_error_handling=args.ucx_error_handling,
            repeat=args.repeat,
            memory=args.memory,
            variants=(*args.variants, *(["verified"] if args.verify else [])),
            layout=args.layout,
        )
    except ValueError as exc:
        print(f"kvfsm bench: {exc}", file=sys.stderr)
        return 2
    try:
        with progress_bar(steps(options), enabled=not args.json, label="measurements") as advance:
            report = run_bench(options, advance)
    except (RuntimeError, TimeoutError) as exc:  # a bench process failed (its error is above)
        print(f"kvfsm bench: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        bench_table(report)
    return 0 if report["verified"] else 1
