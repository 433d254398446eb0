"""`kvfsm bench`: transfer throughput and latency side by side on one geometry and one set of
requests. This first part measures the anchors (issue 5): raw NIXL posted vLLM's way with NIXL's
default agent settings (a1), raw NIXL with the engine's agent settings (a2), and a memcpy of the
same bytes (d). The engine's own figures (b, c) are not measured yet and print as missing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvfsm._bench_raw import BenchPlan, Variant, gbps, memcpy_gbps, plan_requests, run_variant

__all__ = ["BenchOptions", "run_bench"]

_VARIANTS: tuple[Variant, ...] = ("raw_vllm_style", "raw")


class BenchOptions:
    """What `kvfsm bench` was asked for."""

    def __init__(self, *, mode: str, allocation: str, block_kib: int, num_blocks: int,
                 regions: int, requests: int, blocks_per_request: int, inflight: int,
                 seed: int) -> None:  # fmt: skip
        if min(block_kib, num_blocks, regions, requests, blocks_per_request, inflight) < 1:
            raise ValueError("every size and count must be at least 1")
        self.mode, self.allocation, self.seed = mode, allocation, seed
        src, dst = plan_requests(
            requests=requests, blocks=blocks_per_request, num_blocks=num_blocks,
            allocation=allocation, seed=seed,
        )  # fmt: skip
        self.plan = BenchPlan(
            block_bytes=block_kib * 1024, num_blocks=num_blocks, regions=regions,
            op="WRITE" if mode == "push" else "READ", src=src, dst=dst, inflight=inflight,
            seed=seed,
        )  # fmt: skip


def run_bench(options: BenchOptions, advance: Callable[[int], None]) -> dict[str, Any]:
    """Every variant in turn (fresh processes each), then memcpy; the report as a JSON-able
    dict (figures missing so far are None)."""
    plan = options.plan
    report: dict[str, Any] = {
        "mode": options.mode, "op": plan.op, "allocation": options.allocation,
        "block_bytes": plan.block_bytes, "regions": plan.regions, "requests": len(plan.src),
        "blocks_per_request": len(plan.src[0]), "bytes_per_request": plan.bytes_per_request,
        "descriptors_per_request": len(plan.src[0]) * plan.regions, "inflight": plan.inflight,
    }  # fmt: skip
    verified = True
    for variant in _VARIANTS:
        result = run_variant(plan, variant)
        lat_ms = 1e3 * np.asarray(result["latency_s"])
        report[f"{variant}_gbps"] = gbps(plan, result)
        report[f"{variant}_ms_p50"] = float(np.percentile(lat_ms, 50))
        report[f"{variant}_ms_p99"] = float(np.percentile(lat_ms, 99))
        report[f"{variant}_cpu_us_per_request"] = 1e6 * result["cpu_s"] / len(plan.src)
        verified &= bool(result["verified"])
        advance(1)
    report["memcpy_gbps"] = memcpy_gbps(plan)
    advance(1)
    report |= {"engine_gbps": None, "coalesced_gbps": None, "ratio_engine_raw": None,
               "ratio_coalesced_raw": None, "control_us_per_request": None}  # fmt: skip
    report["ratio_raw_vllm_style"] = report["raw_gbps"] / report["raw_vllm_style_gbps"]
    report["ratio_raw_memcpy"] = report["raw_gbps"] / report["memcpy_gbps"]
    report["verified"] = verified
    return report


def steps() -> int:
    """Progress steps of one run."""
    return len(_VARIANTS) + 1
