"""The `kvfsm` command line: `demo`, `bench`, `scenario`, `check`, `diagrams`, `drain`."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from kvfsm.cli import bench, check, demo, diagrams, drain, scenario

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="kvfsm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (demo, bench, scenario, diagrams, check, drain):
        command.add_command(commands)
    for sub in commands.choices.values():
        sub.formatter_class = _WithDefaults
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    if not getattr(args, "json", False):
        return run(args)
    with _json_only_on_stdout():
        return run(args)


class _WithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, where it has one worth showing (not None, not a
    switch's False, not one its help already says)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


@contextlib.contextmanager
def _json_only_on_stdout() -> Iterator[None]:
    """While a `--json` command runs, file descriptor 1 is stderr's, so what native code (UCX
    warns of settings there) and child processes write cannot corrupt the JSON; Python's
    `sys.stdout` still reaches the real stdout (or whatever a caller put in its place)."""
    sys.stdout.flush()
    try:
        real_stdout = sys.stdout.fileno() == 1
    except (AttributeError, ValueError, io.UnsupportedOperation):
        real_stdout = False  # a caller's own stream (tests, redirect_stdout): left in place
    saved = os.dup(1)
    previous = sys.stdout
    try:
        os.dup2(2, 1)
        if real_stdout:
            sys.stdout = open(saved, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        yield
    finally:
        sys.stdout.flush()
        if sys.stdout is not previous:
            sys.stdout.close()
            sys.stdout = previous
        os.dup2(saved, 1)
        os.close(saved)
