"""`kvfsm demo`, the main job: requests through a P and a D engine, every byte checked, a
progress bar and a summary table; real NIXL in a process per rank (`--fabric nixl`, the
default) or the simulated fabric in this process (`--fabric sim`)."""

from __future__ import annotations

import argparse
import json
import sys

import msgspec

from kvfsm.cli._parsing import Commands
from kvfsm.cli.demo._nixl import Driver, Tally, run_nixl_demo
from kvfsm.cli.demo._report import DemoReport, why_not_done
from kvfsm.cli.demo._sim import run_sim_demo
from kvfsm.cli.render import demo_table, progress_bar
from kvfsm.layout import MODELS

__all__ = ["DemoReport", "Driver", "Tally", "add_command", "run_nixl_demo", "run_sim_demo"]


def add_command(commands: Commands) -> None:
    """`kvfsm demo`: P and D engines moving KV, every byte checked."""
    demo = commands.add_parser("demo", help="move KV between a P and a D engine, bytes checked")
    demo.add_argument(
        "--fabric",
        choices=["nixl", "sim"],
        default="nixl",
        help="nixl: P and D processes over real NIXL (default); sim: the simulated fabric",
    )
    demo.add_argument(
        "--mode",
        choices=["push", "pull"],
        default="push",
        help="push: P WRITEs into D's blocks; pull: D READs P's",
    )
    demo.add_argument("--requests", type=int, default=200, help="requests to move")
    demo.add_argument("--seed", type=int, default=0, help="seed of the requests' sizes and blocks")
    demo.add_argument("--p-tp", type=int, default=1, help="P's TP size (one process per rank)")
    demo.add_argument("--d-tp", type=int, default=1, help="D's TP size (one process per rank)")
    demo.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="KV geometry of the real fabric's engines (deepseek-v2-lite: replicated MLA KV;"
        " default: llama3-8b)",
    )
    demo.add_argument(
        "--p-block-size", type=int, default=None, help="tokens per P block (default: the model's)"
    )
    demo.add_argument(
        "--d-block-size",
        type=int,
        default=None,
        help="tokens per D block, a multiple of P's (default: P's)",
    )
    demo.add_argument(
        "--memory-mib",
        type=float,
        default=None,
        help=f"KV cache per rank (real fabric; default {_MEMORY_MIB:g})",
    )
    demo.add_argument(
        "--corrupt",
        type=int,
        default=None,
        metavar="N",
        help="negative control (real fabric): flip one byte of P's KV in N requests; the run "
        "must then report the mismatch and exit 1",
    )
    demo.add_argument(
        "--verify",
        choices=["off", "sample", "all"],
        default="off",
        help="check KV end to end as production would: D checks P's checksum of every"
        " transfer (all) or one in 8 (sample); with --corrupt the byte is flipped after P's"
        " checksum, and D must fail those requests",
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(run=_execute)


_MEMORY_MIB = 256.0


def _refusal(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot run as given (one line), or None; fills in the defaults of
    the flags that apply to the real fabric only."""
    if args.requests < 1:
        return f"--requests must be at least 1, not {args.requests}"
    if args.fabric == "sim":
        given = [f for f in ("model", "memory_mib", "corrupt") if getattr(args, f) is not None]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            return f"{flags}: the real fabric's only (--fabric nixl); the simulated one has its own"
    args.model = args.model or "llama3-8b"
    args.memory_mib = _MEMORY_MIB if args.memory_mib is None else args.memory_mib
    args.corrupt = args.corrupt or 0
    if args.memory_mib <= 0 or args.corrupt < 0:
        return "--memory-mib must be above 0 and --corrupt at least 0"
    return None


def _execute(args: argparse.Namespace) -> int:
    refusal = _refusal(args)
    if refusal is not None:
        print(f"kvfsm demo: {refusal}", file=sys.stderr)
        return 2
    default_bs = 4 if args.fabric == "sim" else MODELS[args.model].block_size
    p_bs = args.p_block_size or default_bs
    d_bs = args.d_block_size or p_bs
    if p_bs < 1 or d_bs % p_bs:
        print(
            f"kvfsm demo: --d-block-size {d_bs} must be a multiple of --p-block-size {p_bs}",
            file=sys.stderr,
        )
        return 2
    try:
        with progress_bar(args.requests, enabled=not args.json) as advance:
            if args.fabric == "nixl":
                report = run_nixl_demo(
                    args.mode,
                    args.requests,
                    seed=args.seed,
                    p_tp=args.p_tp,
                    d_tp=args.d_tp,
                    model=args.model,
                    p_block_size=p_bs,
                    d_block_size=d_bs,
                    memory_mib=args.memory_mib,
                    progress=advance,
                    corrupt=args.corrupt,
                    verify=args.verify,
                )
            else:
                report = run_sim_demo(
                    args.mode,
                    args.requests,
                    seed=args.seed,
                    p_tp=args.p_tp,
                    d_tp=args.d_tp,
                    p_block_size=p_bs,
                    d_block_size=d_bs,
                    progress=advance,
                    verify=args.verify,
                )
    except ValueError as exc:  # a geometry the engines cannot run (TP not splitting heads, ...)
        print(f"kvfsm demo: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:  # a rank failed (its own error is above)
        print(f"kvfsm demo: {exc}", file=sys.stderr)
        return 1
    report.why_not_done = why_not_done(report)
    if args.json:
        print(json.dumps(msgspec.to_builtins(report), sort_keys=True))
    else:
        demo_table(report)
    for line in report.why_not_done:
        print(f"kvfsm demo: {line}", file=sys.stderr)
    return 0 if report.ok else 1
