"""A scenario written in code rather than a TOML file: P's WRITE completes but its completion
notification to D is lost. D must not report blocks it cannot vouch for: it fails the request
at its stall bound, blocks invalid, and the next request is served. Every safety property is
checked as it runs.

Run: python examples/scenario_in_code.py
"""

from __future__ import annotations

from kvfsm.cli.scenario import run_scenario, scenario_of

SCENARIO = {
    "description": "a lost completion fails the request safely; the next one is served",
    "network": {"transfer_latency": 0.05},
    "engines": [{"side": "P", "mode": "push", "tp": 1}, {"side": "D", "mode": "push", "tp": 1}],
    "requests": [{"id": "lost", "blocks": 3}, {"id": "next", "blocks": 2}],
    "timeline": [
        {"do": "admit", "request": "lost"},
        {"do": "finish", "request": "lost"},
        {"do": "until", "request": "lost", "agent": "D#0", "state": "writing"},
        {"do": "fault", "kind": "drop", "agent": "D#0"},
        {"do": "admit", "request": "next"},
        {"do": "finish", "request": "next"},
    ],
    "expect": [
        {"request": "lost", "agent": "D#0", "state": ["failed", "expired"]},
        {"request": "next", "side": "D", "state": "done"},
    ],
}


def main() -> int:
    report = run_scenario(scenario_of(SCENARIO, "lost_completion"), "sim")
    for name, outcome in report.requests.items():
        print(f"{name}: {outcome.final_state}")
    print("passed" if report.passed else f"failed: {report.violations + report.unmet}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
