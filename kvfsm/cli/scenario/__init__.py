"""`kvfsm scenario`: replay scenario files (P and D engines, requests, a timeline, faults) on
the simulated fabric or real NIXL agents; every request's trace and final state, and any broken
safety property or unmet expectation."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from kvfsm.cli._parsing import Commands
from kvfsm.cli.render import progress_bar, scenario_table
from kvfsm.cli.scenario._file import Scenario, ScenarioError, load_scenario, scenario_of
from kvfsm.cli.scenario._run import ScenarioReport, run_scenario

__all__ = [
    "Scenario",
    "ScenarioError",
    "ScenarioReport",
    "add_command",
    "load_scenario",
    "run_scenario",
    "scenario_of",
]


def add_command(commands: Commands) -> None:
    """`kvfsm scenario`: replay scenario files."""
    scenario = commands.add_parser(
        "scenario", help="replay scenario files (engines, requests, a timeline, faults)"
    )
    scenario.add_argument("files", type=Path, nargs="+", metavar="FILE.toml")
    scenario.add_argument(
        "--fabric",
        choices=["sim", "nixl"],
        default="sim",
        help="sim: the simulated fabric (every fault); nixl: real NIXL agents in this process",
    )
    scenario.add_argument("--json", action="store_true", help="print one JSON object per file")
    scenario.set_defaults(run=_execute)


def _execute(args: argparse.Namespace) -> int:
    """Run every file that runs on the fabric (the others skipped with a note), then a summary
    line. Exit 2 if a file is malformed or none could run, else 1 if any failed, else 0."""
    try:
        scenarios = [load_scenario(path) for path in args.files]
    except ScenarioError as exc:
        print(f"kvfsm scenario: {exc}", file=sys.stderr)
        return 2
    reports, skipped, errors = [], 0, 0
    with progress_bar(len(scenarios), enabled=not args.json, label="scenarios") as advance:
        for scenario in scenarios:
            advance(1)
            if args.fabric not in scenario.fabrics:
                skipped += 1
                print(
                    f"kvfsm scenario: {scenario.name}: skipped: it runs on"
                    f" {', '.join(scenario.fabrics)} (its `fabrics`; default sim), not {args.fabric}",
                    file=sys.stderr,
                )
                continue
            try:
                reports.append(run_scenario(scenario, args.fabric))
            except ScenarioError as exc:
                errors += 1
                print(f"kvfsm scenario: {exc}", file=sys.stderr)
    for report in reports:
        if args.json:
            print(json.dumps(msgspec.to_builtins(report), sort_keys=True))
        else:
            scenario_table(report)
    failed = sum(not r.passed for r in reports)
    summary = f"{len(reports) - failed} passed, {failed} failed, {skipped} skipped"
    print(f"kvfsm scenario: {summary}", file=sys.stderr if args.json else sys.stdout)
    if errors or not reports:
        return 2
    return 1 if failed else 0
