"""`kvfsm diagrams`: the state diagrams in docs/diagrams/, generated from models/ (Mermaid in
Markdown, and DOT); `--check` fails when a committed one is stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfsm.cli._parsing import Commands
from kvfsm.cli.diagrams._generate import (
    check_diagrams,
    generate,
    render_dot,
    render_mermaid,
    write_diagrams,
)

__all__ = [
    "add_command",
    "check_diagrams",
    "generate",
    "render_dot",
    "render_mermaid",
    "write_diagrams",
]

_DIAGRAMS = Path("docs/diagrams")


def add_command(commands: Commands) -> None:
    """`kvfsm diagrams`: the state diagrams from models/."""
    diagrams = commands.add_parser("diagrams", help="generate docs/diagrams from models/")
    diagrams.add_argument("--out", type=Path, default=_DIAGRAMS, help="the folder to write")
    diagrams.add_argument("--check", action="store_true", help="fail if they are stale")
    diagrams.add_argument(
        "--svg",
        type=Path,
        default=None,
        metavar="DIR",
        help="also render each model as DIR/NAME.svg (needs Graphviz; SVGs are not committed)",
    )
    diagrams.set_defaults(run=_execute)


def _execute(args: argparse.Namespace) -> int:
    if args.check:
        problems = check_diagrams(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"{args.out} is stale: run `kvfsm diagrams`", file=sys.stderr)
            return 1
        print(f"{args.out} is fresh")
        return 0
    try:
        written = write_diagrams(args.out, svg_dir=args.svg)
    except RuntimeError as exc:  # no Graphviz, or dot failed
        print(f"kvfsm diagrams: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out or --svg names a file, or a folder it may not write
        print(f"kvfsm diagrams: cannot write there: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
