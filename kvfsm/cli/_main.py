"""The `kvfsm` command line: `demo`, `bench`, `scenario`, `check`, `diagrams`."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from kvfsm.cli import bench, check, demo, diagrams, scenario

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="kvfsm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (demo, bench, scenario, diagrams, check):
        command.add_command(commands)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)
