"""A scenario written in code rather than a TOML file: P's WRITE completes but its completion
notifications to D are lost. For the first request D asks P over the side channel before its
watchdog, hears that the WRITE completed, and reports the blocks received. For the second the
side channel to P is cut as well: D must not report blocks it cannot vouch for, so its watchdog
fails the request, blocks invalid. Every safety property is checked as it runs.

Run: python examples/scenario_in_code.py
"""

from __future__ import annotations

from kvfsm.cli.scenario import run_scenario, scenario_of

SCENARIO = {
    "description": "a lost completion is recovered by asking; with no answer, never guessed",
    "engines": [{"side": "P", "mode": "push", "tp": 1}, {"side": "D", "mode": "push", "tp": 1}],
    "requests": [{"id": "asked", "blocks": 3}, {"id": "unanswered", "blocks": 2}],
    "timeline": [
        {"do": "fault", "kind": "lose", "message": "done", "agent": "D#0"},
        {"do": "admit", "request": "asked"},
        {"do": "finish", "request": "asked"},
        {"do": "until", "request": "asked", "agent": "D#0", "state": "done", "within": 5.0},
        {"do": "fault", "kind": "lose", "message": "done", "agent": "D#0"},
        {"do": "admit", "request": "unanswered"},
        {"do": "finish", "request": "unanswered"},
        {"do": "until", "request": "unanswered", "agent": "D#0", "state": "writing"},
        {"do": "fault", "kind": "side_channel_cut", "agent": "P#0"},
    ],
    "expect": [
        {"request": "asked", "side": "D", "state": "done"},
        {"request": "unanswered", "agent": "D#0", "state": ["failed", "expired"]},
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
