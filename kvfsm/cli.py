"""The `kvfsm` command line: `demo`, `bench`, `scenario`, `diagrams`, `check`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeAlias

import msgspec

from kvfsm._presets import MODELS

__all__ = ["main"]

_DIAGRAMS = Path("docs/diagrams")
# argparse types its subparsers' action privately.
_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="kvfsm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_demo, _add_bench, _add_scenario, _add_diagrams, _add_check):
        add(commands)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


def _add_demo(commands: _Commands) -> None:
    """`kvfsm demo`: P and D engines moving KV, every byte checked."""
    demo = commands.add_parser("demo", help="move KV between a P and a D engine, bytes checked")
    demo.add_argument(
        "--fabric", choices=["nixl", "sim"], default="nixl",
        help="nixl: P and D processes over real NIXL (default); sim: the simulated fabric",
    )  # fmt: skip
    demo.add_argument("--mode", choices=["push", "pull"], default="push")
    demo.add_argument("--requests", type=int, default=200)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--p-tp", type=int, default=1, help="P's TP size (one process per rank)")
    demo.add_argument("--d-tp", type=int, default=1, help="D's TP size (one process per rank)")
    demo.add_argument(
        "--model", choices=sorted(MODELS), default="llama3-8b",
        help="KV geometry of the real fabric's engines (deepseek-v2-lite: replicated MLA KV)",
    )  # fmt: skip
    demo.add_argument("--p-block-size", type=int, default=None, help="tokens per P block")
    demo.add_argument(
        "--d-block-size", type=int, default=None, help="tokens per D block (a multiple of P's)"
    )
    demo.add_argument(
        "--memory-mib", type=float, default=256, help="KV cache per rank (real fabric)"
    )
    demo.add_argument(
        "--corrupt", type=int, default=0, metavar="N",
        help="negative control (real fabric): flip one byte of P's KV in N requests; the run "
        "must then report the mismatch and exit 1",
    )  # fmt: skip
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(run=_demo)


def _add_bench(commands: _Commands) -> None:
    """`kvfsm bench`: the engine side by side with raw NIXL and memcpy."""
    bench = commands.add_parser(
        "bench",
        help="throughput side by side: raw NIXL (vLLM's way, kvfsm's settings), the engine, memcpy",
    )
    bench.add_argument(
        "--mode", choices=["push", "pull"], default="push", help="push: WRITE; pull: READ"
    )
    bench.add_argument(
        "--allocation", choices=["contiguous", "fragmented", "realistic"], default="contiguous",
        help="how requests' blocks lie: runs, a shuffled free list, or an allocator after churn",
    )  # fmt: skip
    bench.add_argument("--block-kib", type=int, default=16, help="bytes of one block in one region")
    bench.add_argument("--blocks", type=int, default=2048, help="blocks per region")
    bench.add_argument("--regions", type=int, default=4, help="regions (layers x K/V)")
    bench.add_argument("--requests", type=int, default=64)
    bench.add_argument("--blocks-per-request", type=int, default=16)
    bench.add_argument("--inflight", type=int, default=4, help="transfers in flight at most")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--repeat", type=int, default=3,
        help="rounds of every variant, interleaved; each variant reports its median run",
    )  # fmt: skip
    bench.add_argument(
        "--ucx-error-handling", choices=["peer", "none"], default="peer",
        help="UCX error handling for kvfsm's variants (a1 keeps NIXL's default, peer)",
    )  # fmt: skip
    bench.add_argument(
        "--control-in-flight", type=int, nargs="+", default=[10, 100, 1000, 10000],
        help="requests in flight for the control-plane CPU figures",
    )  # fmt: skip
    bench.add_argument(
        "--control-total", type=int, default=10000,
        help="lifecycles per control-plane measurement (0 skips it)",
    )  # fmt: skip
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=_bench)


def _add_scenario(commands: _Commands) -> None:
    """`kvfsm scenario`: replay scenario files."""
    scenario = commands.add_parser(
        "scenario", help="replay scenario files (engines, requests, a timeline, faults)"
    )
    scenario.add_argument("files", type=Path, nargs="+", metavar="FILE.toml")
    scenario.add_argument(
        "--fabric", choices=["sim", "nixl"], default="sim",
        help="sim: the simulated fabric (every fault); nixl: real NIXL agents in this process",
    )  # fmt: skip
    scenario.add_argument("--json", action="store_true", help="print one JSON object per file")
    scenario.set_defaults(run=_scenario)


def _add_diagrams(commands: _Commands) -> None:
    """`kvfsm diagrams`: the state diagrams from models/."""
    diagrams = commands.add_parser("diagrams", help="generate docs/diagrams from models/")
    diagrams.add_argument("--out", type=Path, default=_DIAGRAMS)
    diagrams.add_argument("--check", action="store_true", help="fail if they are stale")
    diagrams.set_defaults(run=_diagrams)


def _add_check(commands: _Commands) -> None:
    """`kvfsm check`: every interleaving of requests and faults, explored."""
    check = commands.add_parser(
        "check", help="explore every interleaving of requests and faults on the simulated fabric"
    )
    check.add_argument("--mode", choices=["push", "pull", "both"], default="both")
    check.add_argument("--faults", type=int, default=2, help="injected faults per path at most")
    check.add_argument("--requests", type=int, choices=[1, 2], default=2)
    check.add_argument(
        "--depth", type=int, default=None, help="actions per path at most (default: 9, CI's bound)"
    )
    check.add_argument(
        "--workers", type=int, default=None,
        help="processes replaying paths (default: one per CPU; the report is the same)",
    )  # fmt: skip
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(run=_check)


def _demo(args: argparse.Namespace) -> int:
    from kvfsm._demo import run_sim_demo
    from kvfsm._render import demo_table, progress_bar

    if args.requests < 1:
        print("--requests must be at least 1", file=sys.stderr)
        return 2
    default_bs = 4 if args.fabric == "sim" else MODELS[args.model].block_size
    p_bs = args.p_block_size or default_bs
    d_bs = args.d_block_size or p_bs
    if p_bs < 1 or d_bs % p_bs:
        print(f"--d-block-size {d_bs} must be a multiple of --p-block-size {p_bs}", file=sys.stderr)
        return 2
    try:
        with progress_bar(args.requests, enabled=not args.json) as advance:
            if args.fabric == "nixl":
                from kvfsm._nixl_demo import run_nixl_demo

                report = run_nixl_demo(
                    args.mode, args.requests, seed=args.seed, p_tp=args.p_tp, d_tp=args.d_tp,
                    model=args.model, p_block_size=p_bs, d_block_size=d_bs,
                    memory_mib=args.memory_mib, progress=advance, corrupt=args.corrupt,
                )  # fmt: skip
            else:
                report = run_sim_demo(
                    args.mode, args.requests, seed=args.seed, p_tp=args.p_tp, d_tp=args.d_tp,
                    p_block_size=p_bs, d_block_size=d_bs, progress=advance,
                )  # fmt: skip
    except ValueError as exc:  # a geometry the engines cannot run (TP not splitting heads, ...)
        print(f"kvfsm demo: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:  # a rank failed (its own error is above)
        print(f"kvfsm demo: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(msgspec.to_builtins(report), sort_keys=True))
    else:
        demo_table(report)
    return 0 if report.ok else 1


def _bench(args: argparse.Namespace) -> int:
    from kvfsm._bench import BenchOptions, run_bench, steps
    from kvfsm._render import bench_table, progress_bar

    try:
        options = BenchOptions(
            mode=args.mode, allocation=args.allocation, block_kib=args.block_kib,
            num_blocks=args.blocks, regions=args.regions, requests=args.requests,
            blocks_per_request=args.blocks_per_request, inflight=args.inflight, seed=args.seed,
            control_in_flight=tuple(args.control_in_flight), control_total=args.control_total,
            ucx_error_handling=args.ucx_error_handling, repeat=args.repeat,
        )  # fmt: skip
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


def _scenario(args: argparse.Namespace) -> int:
    from kvfsm._render import progress_bar, scenario_table
    from kvfsm.testing._scenario import run_scenario
    from kvfsm.testing._scenario_file import ScenarioError, load_scenario

    try:
        scenarios = [load_scenario(path) for path in args.files]
    except ScenarioError as exc:
        print(f"kvfsm scenario: {exc}", file=sys.stderr)
        return 2
    reports = []
    with progress_bar(len(scenarios), enabled=not args.json, label="scenarios") as advance:
        for scenario in scenarios:
            try:
                reports.append(run_scenario(scenario, args.fabric))
            except ScenarioError as exc:
                print(f"kvfsm scenario: {exc}", file=sys.stderr)
                return 2
            advance(1)
    for report in reports:
        if args.json:
            print(json.dumps(msgspec.to_builtins(report), sort_keys=True))
        else:
            scenario_table(report)
    return 0 if all(r.passed for r in reports) else 1


def _diagrams(args: argparse.Namespace) -> int:
    from kvfsm._diagrams import check_diagrams, write_diagrams

    if args.check:
        problems = check_diagrams(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("docs/diagrams is stale: run `kvfsm diagrams`", file=sys.stderr)
            return 1
        print(f"{args.out} is fresh")
        return 0
    for path in write_diagrams(args.out):
        print(path)
    return 0


def _check(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvfsm._render import figures_table, progress_bar
    from kvfsm.core import Mode
    from kvfsm.testing import MAX_DEPTH, default_workers, run_check

    depth = MAX_DEPTH if args.depth is None else args.depth
    workers = default_workers() if args.workers is None else args.workers
    if args.faults < 0 or depth < 1 or workers < 1:
        print("kvfsm check: --faults must be >= 0, --depth and --workers >= 1", file=sys.stderr)
        return 2
    modes: list[Mode] = ["push", "pull"] if args.mode == "both" else [args.mode]
    with progress_bar(depth * len(modes), enabled=not args.json, label="depth levels") as advance:
        reports = [
            run_check(m, max_faults=args.faults, requests=args.requests, max_depth=depth,
                      workers=workers, progress=advance)
            for m in modes
        ]  # fmt: skip
    found = [{"mode": r.mode, **msgspec.to_builtins(v)} for r in reports for v in r.violations]
    if args.json:
        total = {
            "states_explored": sum(r.states_explored for r in reports),
            "transitions": sum(r.transitions for r in reports),
            "violations": found,
            "modes": {r.mode: msgspec.to_builtins(r) for r in reports},
        }
        print(json.dumps(total, sort_keys=True))
        return 1 if found else 0
    for r in reports:
        figures = {k: v for k, v in msgspec.to_builtins(r).items() if k != "violations"}
        figures_table(f"kvfsm check: {r.mode}", {**figures, "violations": len(r.violations)})
    console = Console()
    for v in found:
        console.print(
            f"violation ({v['mode']}): {'; '.join(v['problems'])}", style="red", markup=False
        )
        for i, step in enumerate(v["trace"], 1):
            console.print(f"  {i:2}. {step}", markup=False)
    return 1 if found else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
