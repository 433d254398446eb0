"""`kvfsm bench`: raw NIXL anchors, the engine per block and coalesced, memcpy; real NIXL agents
and engines in two processes, every transferred byte checked; the figures themselves are not
asserted (benchmarks print them), what was moved and how is."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import numpy as np
import pytest
import torch

from kvfsm.bench import HOPS, BenchPlan, buffer_of, check_sink, churned_free_queue, plan_requests
from kvfsm.cli import main
from kvfsm.cli.render import bench_table

pytestmark = pytest.mark.nixl

_SMALL = ["--block-kib", "4", "--blocks", "64", "--regions", "2", "--requests", "8"]
_SMALL += ["--blocks-per-request", "4", "--control-in-flight", "5", "50", "--control-total", "100"]
_SMALL += ["--repeat", "1"]


@pytest.fixture(scope="module")
def pushed() -> dict[str, Any]:
    """One push run over contiguous blocks, shared by the tests of the report and of its table
    (a run starts ten processes and NIXL agents). How rounds become medians and ratios is tested
    with stand-in runs of known times (tests/bench/test_bench_rounds.py)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["bench", *_SMALL, "--json"]) == 0
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


@pytest.mark.parametrize(
    ("mode", "allocation", "errors"),
    [("push", "contiguous", "peer"), ("pull", "realistic", "none")],
)
def test_bench_reports_every_variant_with_bytes_verified(
    mode: str,
    allocation: str,
    errors: str,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    if (mode, allocation) == ("push", "contiguous"):  # the shared run is this one
        report = request.getfixturevalue("pushed")
    else:
        args = ["--mode", mode, "--allocation", allocation, "--ucx-error-handling", errors]
        assert main(["bench", *args, *_SMALL, "--inflight", "4", "2", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        # Every variant also ran at 2 in flight, its bytes checked; the headline is at 4.
        assert set(report["by_inflight"]) == {"4", "2"}
        assert all(f["verified"] and f["engine_gbps"] > 0 for f in report["by_inflight"].values())
    assert report["verified"] is True and report["ucx_error_handling"] == errors
    assert report["op"] == ("WRITE" if mode == "push" else "READ")
    variants = ("raw_vllm_style", "raw", "raw_unmerged", "engine", "coalesced", "memcpy")
    for key in (*(f"{v}_gbps" for v in variants), "ratio_engine_raw", "ratio_coalesced_raw"):
        assert report[key] > 0
    assert report["descriptors_per_request"] == 8 and report["bytes_per_request"] == 8 * 4096
    # Rows posted per request: one per block per region, except the coalescing engine's.
    for variant in ("raw_vllm_style", "raw", "raw_unmerged", "engine"):
        assert report[f"{variant}_descriptors_per_request"] == 8
    assert report["raw_unmerged_fabric_descriptors_per_request"] == 8  # NIXL merged nothing
    coalesced = report["coalesced_descriptors_per_request"]
    assert report["coalesced_fabric_descriptors_per_request"] == coalesced  # dynamic: no merging
    if allocation == "contiguous":  # one run per region: NIXL's merge and kvfsm's agree
        assert coalesced == 2 == report["raw_fabric_descriptors_per_request"]
        assert report["engine_fabric_descriptors_per_request"] == 2
    else:
        assert 2 <= coalesced <= 8
    assert set(report["control_us_per_request"]) == {"5", "50"}
    assert all(us > 0 for us in report["control_engine_us_per_request"].values())
    # Latency like for like: every request's notification drained at the raw target, and every
    # hop of the engine's hand-offs reached (the figures themselves are the benchmark's).
    assert report["memory"] == "dram" and report["inflight"] == 4
    # Idle, an engine's loop wakes every 50 ms; a spinning one would take a whole core.
    assert all(0 <= cpu < 0.5 for cpu in report["engine_idle_cpu_per_s"].values())
    assert 0 < report["raw_notified_us_p50"] <= report["raw_notified_us_p99"]
    assert 0 < report["handoff_us_p50"] <= report["handoff_us_p99"]
    hops = report["handoff_hops_us"]
    assert set(hops) == {name for name, _, _ in HOPS[mode]}
    assert all(us is not None for us in hops.values())


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_blocks_outermost_move_one_row_per_block(
    mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--layout BLHNC`: each block's pages of every region lie together; raw NIXL posts vLLM's
    row per block per region on that memory, the engine one row per block (regions times
    fewer), and every byte arrives."""
    args = ["--mode", mode, "--layout", "BLHNC", "--variants", "raw", "engine"]
    args += ["--control-total", "0", *_SMALL[:10], "--repeat", "1"]
    assert main(["bench", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] is True and report["layout"] == "BLHNC"
    assert report["raw_descriptors_per_request"] == 8  # 4 blocks x 2 regions
    assert report["engine_descriptors_per_request"] == 4  # 4 blocks


def test_the_byte_check_reads_the_layout_it_was_written_in() -> None:
    src, dst = plan_requests(requests=2, blocks=3, num_blocks=16, allocation="fragmented", seed=1)
    plan = BenchPlan(
        block_bytes=64, num_blocks=16, regions=2, op="WRITE", src=src, dst=dst, blocks_first=True
    )
    sink = buffer_of(plan, False).reshape(16, 2, 64)  # block, region, page
    source = buffer_of(plan, True).reshape(16, 2, 64)
    for s, d in zip(src, dst, strict=True):
        sink[d] = source[s]
    assert check_sink(plan, sink.ravel())
    sink[dst[1][2], 1, 63] ^= 1
    assert not check_sink(plan, sink.ravel())


def test_the_byte_check_fails_on_a_wrong_byte() -> None:
    src, dst = plan_requests(requests=2, blocks=3, num_blocks=16, allocation="fragmented", seed=1)
    plan = BenchPlan(block_bytes=64, num_blocks=16, regions=2, op="WRITE", src=src, dst=dst)
    sink = buffer_of(plan, False).reshape(2, 16, 64)
    source = buffer_of(plan, True).reshape(2, 16, 64)
    for s, d in zip(src, dst, strict=True):
        sink[:, d] = source[:, s]
    assert check_sink(plan, sink.ravel())
    sink[1, dst[1][2], 63] ^= 1
    assert not check_sink(plan, sink.ravel())


def test_plans_are_disjoint_and_fragmented_ones_are_not_runs() -> None:
    src, dst = plan_requests(requests=4, blocks=8, num_blocks=64, allocation="fragmented", seed=0)
    for side in (src, dst):
        flat = [b for row in side for b in row]
        assert len(set(flat)) == len(flat)
    assert any(np.any(np.diff(row) != 1) for row in src)
    with pytest.raises(ValueError, match="do not fit"):
        plan_requests(requests=9, blocks=8, num_blocks=64, allocation="contiguous", seed=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_vram_without_a_cuda_device_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--memory", "vram", *_SMALL]) == 2
    err = capsys.readouterr().err
    assert err == "kvfsm bench: --memory vram needs a CUDA device, and torch sees none here\n"


def test_bench_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--requests", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert main(["bench", "--control-in-flight", "0"]) == 2
    assert "control-plane" in capsys.readouterr().err
    assert main(["bench", "--repeat", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_the_table_shows_every_row(
    pushed: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    bench_table(pushed)  # what `kvfsm bench` prints without --json
    out = capsys.readouterr().out
    rows = ("a1 raw", "a2 raw", "unmerged", "b  engine", "c  engine", "d  memcpy")
    assert all(s in out for s in (*rows, "control", "every byte verified"))
    assert "b/a2 " in out and "round by round: " in out and "c/a1 " in out
    assert "µs a request over raw NIXL's" in out and "b/a2 >= 0.95 allows" in out
    words = " ".join(out.split())  # the console wraps lines as it likes
    assert "hand-off p50" in words and "post to notification drained" in words
    assert "engine idle: P " in words
    assert all(f"{name} " in words for name, _, _ in HOPS["push"])  # every hop, named


def test_a_churned_free_queue_holds_every_block_once_in_broken_runs() -> None:
    queue = churned_free_queue(256, 8, np.random.default_rng(3))
    assert sorted(queue) == list(range(256))
    breaks = int(np.count_nonzero(np.diff(queue) != 1))
    assert 0 < breaks < 255  # neither the fresh pool's one run nor a shuffle
    src, _ = plan_requests(requests=4, blocks=8, num_blocks=64, allocation="realistic", seed=0)
    assert len({b for row in src for b in row}) == 32
    with pytest.raises(ValueError, match="allocation must be one of"):
        plan_requests(requests=1, blocks=1, num_blocks=4, allocation="packed", seed=0)
