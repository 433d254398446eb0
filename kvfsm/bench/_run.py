"""`kvfsm bench`: transfer throughput and latency side by side on one geometry and one set of
requests: raw NIXL posted vLLM's way with NIXL's default agent settings (a1), raw NIXL
with the engine's agent settings (a2; and a2 without NIXL's merging of adjacent rows, to show what
that merging is worth), the kvfsm engine posting one row per block per region (b) and coalescing
(c), a copy of the same bytes in the same memory (d: memcpy on the host, a torch device copy on a
GPU), and the control plane's CPU per request lifecycle at several numbers of requests in flight.

Latency like for like: raw NIXL's from the post until the other side drained the transfer's
notification (`raw_notified_us_*`), the engine's from D's admission (P's prefill finished) to
D's report (`handoff_us_*`), with the engine's hops in between (`handoff_hops_us`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from kvfsm.bench._control import control_bench
from kvfsm.bench._engine import HOPS, run_engine_variant
from kvfsm.bench._memory import MEMORIES, Memory
from kvfsm.bench._raw import BenchPlan, gbps, memcpy_gbps, plan_requests, run_variant
from kvfsm.core import Mode
from kvfsm.fabric import UcxErrorHandling
from kvfsm.harness import require_memory

__all__ = ["DEFAULT_VARIANTS", "LAYOUTS", "VARIANTS", "BenchOptions", "run_bench", "steps"]

# Report key -> how to run it, in the order they run.
_VARIANTS: dict[str, Callable[[BenchPlan], dict[str, Any]]] = {
    "raw_vllm_style": lambda plan: run_variant(plan, "raw_vllm_style"),
    "raw": lambda plan: run_variant(plan, "raw"),
    "raw_unmerged": lambda plan: run_variant(plan, "raw_unmerged"),
    "engine": lambda plan: run_engine_variant(plan, coalesce=False),
    "coalesced": lambda plan: run_engine_variant(plan, coalesce=True),
    "verified": lambda plan: run_engine_variant(plan, coalesce=False, verify="all"),
}
VARIANTS = tuple(_VARIANTS)
"""The variants' report keys; "raw" and "engine" (a2 and b, the headline ratio) always run;
"verified" (b with `verify = "all"`: checksums on both sides) only when asked."""
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "verified")
# Ratio key -> (numerator, denominator) variants; a ratio is None where one of them did not run.
_RATIOS = {
    "ratio_engine_raw": ("engine", "raw"),
    "ratio_coalesced_raw": ("coalesced", "raw_vllm_style"),
    "ratio_coalesced_engine": ("coalesced", "engine"),
    "ratio_raw_vllm_style": ("raw", "raw_vllm_style"),
    "ratio_raw_unmerged": ("raw", "raw_unmerged"),
    "ratio_verified_engine": ("verified", "engine"),
}


LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
"""vLLM's KV cache layouts `kvfsm bench --layout` lays its caches out in. The bench's KV is one
latent head per layer, so heads-first and tokens-first pages are the same bytes: what differs
is whether a block's pages of every layer lie together (BL*)."""


class BenchOptions:
    """What `kvfsm bench` was asked for."""

    def __init__(
        self,
        *,
        mode: str,
        allocation: str,
        block_kib: int,
        num_blocks: int,
        regions: int,
        requests: int,
        blocks_per_request: int,
        inflight: int,
        seed: int,
        control_in_flight: tuple[int, ...] = (),
        control_total: int = 0,
        ucx_error_handling: UcxErrorHandling = "peer",
        repeat: int = 1,
        memory: Memory = "dram",
        more_inflight: tuple[int, ...] = (),
        variants: tuple[str, ...] = DEFAULT_VARIANTS,
        layout: str = "LBHNC",
    ) -> None:
        """`inflight`: the headline's transfers in flight at most; `more_inflight`: further
        numbers every variant also runs at (`by_inflight`); `variants`: which run (a GPU's
        short lease may want a2 and b alone)."""
        if unknown := set(variants) - set(VARIANTS):
            raise ValueError(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
        self.variants = tuple(v for v in VARIANTS if v in {"raw", "engine", *variants})
        sizes = {
            "--block-kib": block_kib,
            "--blocks": num_blocks,
            "--regions": regions,
            "--requests": requests,
            "--blocks-per-request": blocks_per_request,
            "--inflight": min((inflight, *more_inflight)),
            "--repeat": repeat,
        }
        if small := [f"{flag} {value}" for flag, value in sizes.items() if value < 1]:
            raise ValueError(f"{', '.join(small)}: every size and count must be at least 1")
        self.repeat, self.more_inflight = repeat, more_inflight
        if layout not in LAYOUTS:
            raise ValueError(f"--layout must be one of {LAYOUTS}, not {layout!r}")
        self.layout = layout
        if memory not in MEMORIES:
            raise ValueError(f"memory must be one of {MEMORIES}, not {memory!r}")
        if control_total < 0 or any(n < 1 for n in control_in_flight):
            raise ValueError("control-plane counts must be at least 1 (a total of 0 skips it)")
        # At most three buffers live at once: one side's, and the sink's with the source
        # regenerated beside it for the byte check.
        buffer = block_kib * 1024 * num_blocks * regions
        require_memory(
            3 * buffer,
            f"three KV buffers of {buffer / 2**30:,.2f} GiB (source, sink, byte check)",
            "fewer --blocks or --regions, or a smaller --block-kib",
        )
        self.mode, self.allocation, self.seed = mode, allocation, seed
        self.control_in_flight = control_in_flight if control_total else ()
        self.control_total = control_total
        src, dst = plan_requests(
            requests=requests,
            blocks=blocks_per_request,
            num_blocks=num_blocks,
            allocation=allocation,
            seed=seed,
        )
        self.plan = BenchPlan(
            block_bytes=block_kib * 1024,
            num_blocks=num_blocks,
            regions=regions,
            op="WRITE" if mode == "push" else "READ",
            src=src,
            dst=dst,
            inflight=inflight,
            seed=seed,
            ucx_error_handling=ucx_error_handling,
            memory=memory,
            blocks_first=layout.startswith("BL"),
        )


def run_bench(options: BenchOptions, advance: Callable[[int], None]) -> dict[str, Any]:
    """Every variant in turn (fresh processes each), `options.repeat` rounds, at each number of
    transfers in flight; then memcpy and the control plane. The report as a JSON-able dict: each
    variant's median run at the first number in flight (`inflight`), with every run's GB/s in
    round order and b/a2 round by round; with more numbers, the same figures for each under
    `by_inflight`."""
    plan = options.plan
    report: dict[str, Any] = {
        "mode": options.mode,
        "op": plan.op,
        "allocation": options.allocation,
        "block_bytes": plan.block_bytes,
        "regions": plan.regions,
        "requests": len(plan.src),
        "blocks_per_request": len(plan.src[0]),
        "bytes_per_request": plan.bytes_per_request,
        "descriptors_per_request": len(plan.src[0]) * plan.regions,
        "inflight": plan.inflight,
        "ucx_error_handling": plan.ucx_error_handling,
        "repeat": options.repeat,
        "memory": plan.memory,
        "layout": options.layout,
    }
    sweep = {
        str(n): _transfers(msgspec.structs.replace(plan, inflight=n), options, advance)
        for n in (plan.inflight, *options.more_inflight)
    }
    report |= sweep[str(plan.inflight)]
    if options.more_inflight:
        report["by_inflight"] = sweep
    report["memcpy_gbps"] = memcpy_gbps(plan)
    advance(1)
    report |= _control_plane(options, advance)
    report |= {
        "ratio_raw_memcpy": report["raw_gbps"] / report["memcpy_gbps"],
        "ratio_coalesced_memcpy": (
            report["coalesced_gbps"] / report["memcpy_gbps"] if "coalesced_gbps" in report else None
        ),
        "verified": all(bool(figures["verified"]) for figures in sweep.values()),
    }
    return report


def _transfers(
    plan: BenchPlan, options: BenchOptions, advance: Callable[[int], None]
) -> dict[str, Any]:
    """Every variant's rounds at `plan.inflight`: medians, rounds, latency and ratios."""
    # Rounds of every variant in turn, so that a slow spell of this shared machine hits them
    # alike; each variant reports its median run.
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in options.variants}
    for _ in range(options.repeat):
        for variant in options.variants:
            runs[variant].append(_VARIANTS[variant](plan))
            advance(1)
    figures: dict[str, Any] = {}
    medians = {}
    for variant, results in runs.items():
        medians[variant] = sorted(results, key=lambda r: gbps(plan, r))[(len(results) - 1) // 2]
        figures |= _figures(plan, variant, medians[variant])
        figures[f"{variant}_gbps_runs"] = [gbps(plan, r) for r in results]  # in round order
    figures |= _latency(options.mode, medians["raw"], medians["engine"])
    figures["engine_idle_cpu_per_s"] = medians["engine"].get("idle_cpu_per_s")
    # b/a2 per request: each median's time per request, from its throughput. b/a2 >= 0.95
    # leaves the engine raw NIXL's time / 19 a request, at any request size.
    raw_us, engine_us = (
        1e-3 * plan.bytes_per_request / figures[f"{v}_gbps"] for v in ("raw", "engine")
    )
    ratios = {
        key: figures[f"{a}_gbps"] / figures[f"{b}_gbps"] if a in runs and b in runs else None
        for key, (a, b) in _RATIOS.items()
    }
    return (
        figures
        | ratios
        | {
            "variants": list(runs),
            "raw_time_us_per_request": raw_us,
            "engine_extra_us_per_request": engine_us - raw_us,
            # b/a2 within each round: how far the headline ratio (of the medians) can be trusted.
            "ratio_engine_raw_by_round": [
                b / a2
                for b, a2 in zip(figures["engine_gbps_runs"], figures["raw_gbps_runs"], strict=True)
            ],
            "verified": all(bool(r["verified"]) for results in runs.values() for r in results),
        }
    )


def _figures(plan: BenchPlan, variant: str, result: dict[str, Any]) -> dict[str, Any]:
    """One variant's figures: GB/s, latency percentiles, CPU and descriptors per request (as
    posted, and as moved after NIXL's merging where its telemetry says)."""
    lat_ms = 1e3 * np.asarray(result["latency_s"])
    n = len(plan.src)
    moved = result.get("fabric_descriptors")
    return {
        f"{variant}_gbps": gbps(plan, result),
        f"{variant}_ms_p50": float(np.percentile(lat_ms, 50)),
        f"{variant}_ms_p99": float(np.percentile(lat_ms, 99)),
        f"{variant}_cpu_us_per_request": 1e6 * result["cpu_s"] / n,
        f"{variant}_descriptors_per_request": result["descriptors"] / n,
        f"{variant}_fabric_descriptors_per_request": None if moved is None else moved / n,
    }


def _latency(mode: str, raw: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """Like-for-like latency of a2 (post to the target's notification drained) and b (D's
    admission to D's report, and hop by hop: each hop's median), in µs."""
    notified, handoff = (1e6 * np.asarray(r) for r in (raw["notified_s"], engine["latency_s"]))
    hops = engine["hops_s"]
    return {
        "raw_notified_us_p50": float(np.percentile(notified, 50)),
        "raw_notified_us_p99": float(np.percentile(notified, 99)),
        "handoff_us_p50": float(np.percentile(handoff, 50)),
        "handoff_us_p99": float(np.percentile(handoff, 99)),
        "handoff_hops_us": {
            name: 1e6 * float(np.median(hops[name])) if hops[name] else None
            for name, _, _ in HOPS[mode]
        },
    }


def _control_plane(options: BenchOptions, advance: Callable[[int], None]) -> dict[str, Any]:
    """CPU µs per request lifecycle (P and D, no data) by requests in flight: the core alone,
    and two engines on the simulated fabric."""
    core: dict[str, float] = {}
    engine: dict[str, float] = {}
    mode: Mode = "push" if options.mode == "push" else "pull"
    for n in options.control_in_flight:
        figures = control_bench(mode, n, max(options.control_total, n), repeat=1)
        core[str(n)], engine[str(n)] = figures["core_us"], figures["engine_us"]
        advance(1)
    return {"control_us_per_request": core or None, "control_engine_us_per_request": engine or None}


def steps(options: BenchOptions) -> int:
    """Progress steps of one run."""
    sweep = 1 + len(options.more_inflight)
    return len(options.variants) * options.repeat * sweep + 1 + len(options.control_in_flight)
