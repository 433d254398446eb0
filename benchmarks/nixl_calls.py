"""Where the posting side's time goes, timed call by call: raw NIXL (a2) against the engine (b).

    .venv/bin/python benchmarks/nixl_calls.py [--mode push|pull] [--requests 512]
        [--regions 4] [--rounds 6] [--json]

`kvfsm bench`'s a2 and b variants, interleaved round by round, 16 KiB blocks, 16 a request
(`--regions 4`: 1 MiB requests). In every bench process each `NixlFabric` call is timed
(`perf_counter_ns` around it), counted from the end of the first transfer on (the warm-up's).
For the posting side (the initiator; P in push, D in pull) it reports, as medians over the
rounds: the time per request (wall / requests), the time per request inside NIXL's calls, the
rest (Python, sleeps), and each call's count and time per request. The engine's time per
request over raw NIXL's splits into what it spends in NIXL calls that raw NIXL does not make
or makes cheaper (the protocol's notifications) and what it spends outside NIXL. UCX does a
transfer's copying inside whichever call progresses the worker (the post, a check, a drain), so
the split between calls is where the time went, not each call's cost alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from profile_engine import contiguous_plan  # beside this script

from kvfsm.bench import BenchPlan, run_engine_variant, run_variant
from kvfsm.fabric import NixlFabric

_ENV = "KVFSM_NIXL_CALLS_DIR"
_CALLS = (
    "make_prepped_xfer",
    "transfer",
    "check_xfer_state",
    "release_xfer_handle",
    "xfer_telemetry",
    "send_notif",
    "get_new_notifs",
)
_calls: Counter[str] = Counter()
_ns: Counter[str] = Counter()
_warm = [False]  # counting starts once the warm-up's transfer returned


def _timed(name: str) -> Any:
    call = getattr(NixlFabric, name)

    def timed(self: NixlFabric, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        result = call(self, *args, **kwargs)
        if _warm[0]:
            _calls[name] += 1
            _ns[name] += time.perf_counter_ns() - t0
        elif name == "transfer":
            _warm[0] = True
        return result

    return timed


def _close_and_dump(close: Any) -> Any:
    def dump(self: NixlFabric) -> None:
        path = Path(os.environ[_ENV]) / f"{os.getpid()}.json"
        path.write_text(json.dumps({"agent": self.agent_name, "calls": _calls, "ns": _ns}))
        close(self)

    return dump


# Spawned bench processes import this module as their main one: the timing goes in there.
if os.environ.get(_ENV):
    for _name in _CALLS:
        setattr(NixlFabric, _name, _timed(_name))
    NixlFabric.close = _close_and_dump(NixlFabric.close)  # type: ignore[method-assign]


def _one_run(plan: BenchPlan, variant: str, poster: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        os.environ[_ENV] = out
        try:
            result = (
                run_engine_variant(plan, coalesce=False)
                if variant == "b"
                else run_variant(plan, "raw")
            )
        finally:
            del os.environ[_ENV]
        sides = [json.loads(p.read_text()) for p in Path(out).glob("*.json")]
    side = next(s for s in sides if s["agent"].startswith(poster))
    n = len(plan.src)
    per_call = {k: (side["calls"][k] / n, side["ns"][k] / n / 1e3) for k in side["calls"]}
    wall = result["wall_s"] / n * 1e6
    inside = sum(us for _, us in per_call.values())
    return {"wall_us": wall, "nixl_us": inside, "rest_us": wall - inside, "calls": per_call}


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({k for r in runs for k in r["calls"]})
    return {
        **{k: statistics.median(r[k] for r in runs) for k in ("wall_us", "nixl_us", "rest_us")},
        "calls": {
            k: [statistics.median(r["calls"].get(k, (0.0, 0.0))[i] for r in runs) for i in (0, 1)]
            for k in names
        },
    }


def main() -> None:
    """Interleaved rounds of a2 and b; medians per request on the posting side."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--regions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    plan = contiguous_plan(args.mode, args.requests, args.regions)
    posters = {"a2": "bench-initiator", "b": "P" if args.mode == "push" else "D"}
    runs: dict[str, list[dict[str, Any]]] = {"a2": [], "b": []}
    for r in range(args.rounds):
        for variant, poster in posters.items():
            runs[variant].append(_one_run(plan, variant, poster))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    report = {v: _medians(rs) for v, rs in runs.items()}
    if args.json:
        print(json.dumps(report))
        return
    for variant, m in report.items():
        print(
            f"{variant}: {m['wall_us']:.1f} µs a request; in NIXL {m['nixl_us']:.1f},"
            f" outside {m['rest_us']:.1f}"
        )
        for name, (count, us) in m["calls"].items():
            print(f"    {name:20s} {count:5.2f} calls  {us:6.1f} µs a request")


if __name__ == "__main__":
    main()
