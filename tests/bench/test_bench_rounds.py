"""How `kvfsm bench` turns its rounds into a report: each variant's median run, every run in
round order, b/a2 paired within each round, the engine's extra time per request, and latency like
for like, hop by hop. The runs
are stand-ins with known wall times (the real variants, with NIXL, are in
tests/bench/test_bench.py): the aggregation is what is tested here, and with real runs no test
can know which order the rounds came in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest

import kvfsm.bench._run as bench
from kvfsm.bench import HOPS, BenchPlan, handoff_hops

# Wall seconds of each variant's run, round by round.
_WALLS = {"raw": [1.0, 4.0, 2.0], "engine": [2.0, 2.5, 8.0]}


def _stand_in(walls: list[float]) -> Callable[[BenchPlan], dict[str, Any]]:
    rounds = iter(walls)

    def run(plan: BenchPlan) -> dict[str, Any]:
        rows = len(plan.src[0]) * plan.regions * len(plan.src)
        wall = next(rounds)
        return {
            "wall_s": wall,
            "latency_s": [wall * 1e-3],
            "cpu_s": 1e-3,
            "verified": True,
            "descriptors": rows,
            "fabric_descriptors": rows,
            "notified_s": [wall * 2e-3],
            "hops_s": {name: [wall * 1e-4] for name, _, _ in HOPS["push"]},
        }

    return run


def test_rounds_keep_their_order_and_b_over_a2_is_paired_within_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variant in bench._VARIANTS:
        monkeypatch.setitem(bench._VARIANTS, variant, _stand_in(_WALLS.get(variant, [1.0] * 3)))
    options = bench.BenchOptions(
        mode="push",
        allocation="contiguous",
        block_kib=4,
        num_blocks=8,
        regions=2,
        requests=2,
        blocks_per_request=2,
        inflight=1,
        seed=0,
        repeat=3,
    )
    steps: list[int] = []
    report = bench.run_bench(options, steps.append)
    moved = options.plan.bytes_per_request * 2 / 1e9  # GB per run
    assert report["raw_gbps_runs"] == pytest.approx([moved / w for w in _WALLS["raw"]])
    assert report["engine_gbps_runs"] == pytest.approx([moved / w for w in _WALLS["engine"]])
    # Medians: raw's 2 s run, engine's 2.5 s one; their ratio, and each round's own.
    assert report["raw_gbps"] == pytest.approx(moved / 2)
    assert report["engine_gbps"] == pytest.approx(moved / 2.5)
    assert report["ratio_engine_raw"] == pytest.approx(0.8)
    assert report["ratio_engine_raw_by_round"] == pytest.approx([0.5, 1.6, 0.25])
    # The same medians per request (2 requests a run): 1 s raw, 0.25 s more for the engine.
    assert report["raw_time_us_per_request"] == pytest.approx(1e6)
    assert report["engine_extra_us_per_request"] == pytest.approx(0.25e6)
    assert len(steps) == bench.steps(options) and report["verified"] is True
    # Latency from the same medians: a2's post to notification drained, b's hand-off and hops.
    assert report["raw_notified_us_p50"] == pytest.approx(2 * 2e3)
    assert report["handoff_us_p50"] == report["handoff_us_p99"] == pytest.approx(2.5e3)
    assert report["handoff_hops_us"] == pytest.approx({n: 2.5e2 for n, _, _ in HOPS["push"]})
    assert report["memory"] == "dram"


def test_every_number_in_flight_gets_its_own_rounds_and_the_first_heads_the_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def by_inflight(seconds: float) -> Callable[[BenchPlan], dict[str, Any]]:
        def run(plan: BenchPlan) -> dict[str, Any]:  # more in flight: faster, here
            return _stand_in([seconds / plan.inflight])(plan) | {"idle_cpu_per_s": {"P": 0.0}}

        return run

    for variant in bench._VARIANTS:
        monkeypatch.setitem(
            bench._VARIANTS, variant, by_inflight(2.0 if variant == "engine" else 1.0)
        )
    options = bench.BenchOptions(
        mode="push",
        allocation="contiguous",
        block_kib=4,
        num_blocks=8,
        regions=2,
        requests=2,
        blocks_per_request=2,
        inflight=4,
        seed=0,
        more_inflight=(1,),
    )
    steps: list[int] = []
    report = bench.run_bench(options, steps.append)
    moved = options.plan.bytes_per_request * 2 / 1e9
    sweep = report["by_inflight"]
    assert list(sweep) == ["4", "1"] and report["inflight"] == 4
    assert sweep["1"]["raw_gbps"] == pytest.approx(moved) and sweep["1"]["ratio_engine_raw"] == 0.5
    assert sweep["4"]["raw_gbps"] == pytest.approx(4 * moved) == report["raw_gbps"]
    assert report["engine_idle_cpu_per_s"] == {"P": 0.0} and report["verified"] is True
    assert len(steps) == bench.steps(options) == 5 * 2 + 1 + len(options.control_in_flight)


def test_hops_run_from_each_point_to_the_next_and_skip_a_point_never_reached() -> None:
    entered = {
        "P": {"bench0": {"on registration": 1.5, "writing": 1.75, "done": 3.0}, "bench1": {}},
        "D": {"bench0": {"registered": 1.25, "done": 3.5}, "bench1": {"registered": 11.0}},
    }
    hops = handoff_hops("push", {"bench0": 1.0, "bench1": 10.0}, entered, {"bench0": 4.0})
    assert hops == {
        "D registers": [0.25, 1.0],
        "registration at P": [0.25],
        "post": [0.25],
        "DONE at P": [1.25],
        "notification at D": [0.5],
        "report": [0.5],
    }


def test_only_the_chosen_variants_run_and_ratios_need_both_of_theirs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[str] = []
    for variant in bench._VARIANTS:
        stand_in = _stand_in([1.0] * 3)

        def run(plan: BenchPlan, v: str = variant, s: Any = stand_in) -> dict[str, Any]:
            ran.append(v)
            return cast(dict[str, Any], s(plan))

        monkeypatch.setitem(bench._VARIANTS, variant, run)
    options = bench.BenchOptions(
        mode="push",
        allocation="contiguous",
        block_kib=4,
        num_blocks=8,
        regions=2,
        requests=2,
        blocks_per_request=2,
        inflight=1,
        seed=0,
        variants=("raw_unmerged",),
    )
    assert options.variants == ("raw", "raw_unmerged", "engine")  # a2 and b always run
    report = bench.run_bench(options, lambda _: None)
    assert ran == ["raw", "raw_unmerged", "engine"] and report["variants"] == ran
    assert report["ratio_engine_raw"] == report["ratio_raw_unmerged"] == pytest.approx(1.0)
    assert report["ratio_coalesced_raw"] is None and "coalesced_gbps" not in report
    with pytest.raises(ValueError, match="unknown variants"):
        bench.BenchOptions(
            mode="push",
            allocation="contiguous",
            block_kib=4,
            num_blocks=8,
            regions=2,
            requests=2,
            blocks_per_request=2,
            inflight=1,
            seed=0,
            variants=("fastest",),
        )
