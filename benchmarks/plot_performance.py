"""The figures of docs/performance.md as one PNG (`make plots`): throughput against descriptor
size for every `kvfsm bench` variant, and the control plane's CPU per request lifecycle against
requests in flight.

Each descriptor size moves the same bytes per request (blocks per request shrink as blocks
grow) on a fragmented allocation, so every block stays a descriptor and the size is what the
fabric sees. Prints the measurements as JSON (`--json-out` keeps them) and writes the PNG.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvfsm.bench import BenchOptions, control_bench, run_bench

_VARIANTS = {
    "raw_vllm_style": "a1 raw NIXL, vLLM's way",
    "raw": "a2 raw NIXL, kvfsm's settings",
    "engine": "b kvfsm engine, per block",
    "coalesced": "c kvfsm engine, coalesced",
    "memcpy": "d memcpy",
}


def measure(sizes_kib: list[int], request_kib: int, requests: int, mode: str) -> dict[str, Any]:
    """Throughput by descriptor size, and control-plane CPU by requests in flight."""
    regions = 4
    by_size: dict[str, dict[str, Any]] = {}
    for kib in sizes_kib:
        per_request = max(1, request_kib // (kib * regions))
        options = BenchOptions(
            mode=mode,
            allocation="fragmented",
            block_kib=kib,
            num_blocks=requests * per_request,
            regions=regions,
            requests=requests,
            blocks_per_request=per_request,
            inflight=4,
            seed=0,
        )
        report = run_bench(options, lambda _: None)
        by_size[str(kib)] = {k: report[f"{k}_gbps"] for k in _VARIANTS}
        print(f"{kib} KiB descriptors: {by_size[str(kib)]}", flush=True)
    control = {}
    for n in (10, 100, 1000, 10000):
        control[str(n)] = control_bench("push" if mode == "push" else "pull", n, max(n, 20000), 1)
        print(f"{n} in flight: {control[str(n)]}", flush=True)
    return {"mode": mode, "request_kib": request_kib, "gbps_by_size": by_size, "control": control}


def plot(figures: dict[str, Any], out: Path) -> None:
    """Two panels: GB/s against descriptor KiB; CPU µs per lifecycle against requests in flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = [int(k) for k in figures["gbps_by_size"]]
    for key, label in _VARIANTS.items():
        left.plot(sizes, [figures["gbps_by_size"][str(s)][key] for s in sizes], "o-", label=label)
    left.set(
        xscale="log",
        xlabel="descriptor size (KiB)",
        ylabel="GB/s",
        title=f"{figures['mode']}: {figures['request_kib']} KiB per request, fragmented",
    )
    left.set_xticks(sizes, [str(s) for s in sizes])
    left.minorticks_off()
    left.legend(fontsize=8)
    counts = [int(n) for n in figures["control"]]
    for key, label in (("core_us", "core (P + D)"), ("engine_us", "engines on SimFabric")):
        right.plot(counts, [figures["control"][str(n)][key] for n in counts], "o-", label=label)
    right.axhline(50, color="grey", linestyle=":", label="goal: 50 µs")
    right.set(
        xscale="log",
        xlabel="requests in flight",
        ylabel="CPU µs per request lifecycle",
        title="control plane",
        ylim=(0, None),
    )
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--request-kib", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument("--out", type=Path, default=Path("docs/performance.png"))
    parser.add_argument("--json-out", type=Path, help="keep the measurements here")
    parser.add_argument("--from-json", type=Path, help="plot these measurements, measure nothing")
    args = parser.parse_args()
    if args.from_json:
        figures = json.loads(args.from_json.read_text())
    else:
        figures = measure(args.sizes_kib, args.request_kib, args.requests, args.mode)
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=1, sort_keys=True))
    plot(figures, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
