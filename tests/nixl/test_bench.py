"""`kvfsm bench` (first part: raw NIXL anchors and memcpy): real NIXL agents in two processes,
every transferred byte checked; the figures themselves are not asserted (benchmarks print them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvfsm._bench_raw import BenchPlan, _buffer, _check, plan_requests
from kvfsm.cli import main

_SMALL = ["--block-kib", "4", "--blocks", "64", "--regions", "2", "--requests", "8"]
_SMALL += ["--blocks-per-request", "4", "--control-in-flight", "5", "50", "--control-total", "100"]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("allocation", ["contiguous", "fragmented"])
def test_bench_reports_every_variant_with_bytes_verified(
    mode: str, allocation: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--mode", mode, "--allocation", allocation, *_SMALL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] is True
    assert report["op"] == ("WRITE" if mode == "push" else "READ")
    for key in ("raw_vllm_style_gbps", "raw_gbps", "memcpy_gbps", "ratio_raw_vllm_style"):
        assert report[key] > 0
    assert report["descriptors_per_request"] == 8 and report["bytes_per_request"] == 8 * 4096
    for key in ("engine_gbps", "coalesced_gbps", "ratio_engine_raw", "ratio_coalesced_raw"):
        assert report[key] is None  # not measured yet: said, not invented
    assert set(report["control_us_per_request"]) == {"5", "50"}
    assert all(us > 0 for us in report["control_engine_us_per_request"].values())


def test_the_byte_check_fails_on_a_wrong_byte() -> None:
    src, dst = plan_requests(requests=2, blocks=3, num_blocks=16, allocation="fragmented", seed=1)
    plan = BenchPlan(block_bytes=64, num_blocks=16, regions=2, op="WRITE", src=src, dst=dst)
    sink = _buffer(plan, False).reshape(2, 16, 64)
    source = _buffer(plan, True).reshape(2, 16, 64)
    for s, d in zip(src, dst, strict=True):
        sink[:, d] = source[:, s]
    assert _check(plan, sink.ravel())
    sink[1, dst[1][2], 63] ^= 1
    assert not _check(plan, sink.ravel())


def test_plans_are_disjoint_and_fragmented_ones_are_not_runs() -> None:
    src, dst = plan_requests(requests=4, blocks=8, num_blocks=64, allocation="fragmented", seed=0)
    for side in (src, dst):
        flat = [b for row in side for b in row]
        assert len(set(flat)) == len(flat)
    assert any(np.any(np.diff(row) != 1) for row in src)
    with pytest.raises(ValueError, match="do not fit"):
        plan_requests(requests=9, blocks=8, num_blocks=64, allocation="contiguous", seed=0)


def test_bench_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--requests", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert main(["bench", "--control-in-flight", "0"]) == 2
    assert "control-plane" in capsys.readouterr().err


def test_the_table_shows_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *_SMALL]) == 0
    out = capsys.readouterr().out
    assert all(s in out for s in ("a1 raw NIXL", "d  memcpy", "not measured", "control"))
