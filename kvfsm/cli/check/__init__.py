"""`kvfsm check`: every interleaving of admits, prefills, aborts, clock steps and injected faults,
within a bound, on one P and one D engine on the simulated fabric, every safety property checked
in every state; a shortest trace for any violation."""

from __future__ import annotations

import argparse
import json
import sys

import msgspec
from rich.console import Console

from kvfsm.cli._parsing import Commands
from kvfsm.cli.check._replay import MAX_DEPTH, CheckReport, CheckViolation
from kvfsm.cli.check._search import default_workers, run_check
from kvfsm.cli.render import figures_table, progress_bar
from kvfsm.core import Mode

__all__ = [
    "MAX_DEPTH",
    "CheckReport",
    "CheckViolation",
    "add_command",
    "default_workers",
    "run_check",
]


def add_command(commands: Commands) -> None:
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
        "--workers",
        type=int,
        default=None,
        help="processes replaying paths (default: one per CPU; the report is the same)",
    )
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(run=_execute)


def _execute(args: argparse.Namespace) -> int:
    depth = MAX_DEPTH if args.depth is None else args.depth
    workers = default_workers() if args.workers is None else args.workers
    if args.faults < 0 or depth < 1 or workers < 1:
        print("kvfsm check: --faults must be >= 0, --depth and --workers >= 1", file=sys.stderr)
        return 2
    modes: list[Mode] = ["push", "pull"] if args.mode == "both" else [args.mode]
    with progress_bar(depth * len(modes), enabled=not args.json, label="depth levels") as advance:
        reports = [
            run_check(
                m,
                max_faults=args.faults,
                requests=args.requests,
                max_depth=depth,
                workers=workers,
                progress=advance,
            )
            for m in modes
        ]
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
