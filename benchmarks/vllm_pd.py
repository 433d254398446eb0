"""Hand-off latency of real vLLM P/D pairs: vLLM's NIXL connectors against kvfsm's (a benchmark).

For each connector, a fresh P engine and D engine (``kvfsm.harness.vllm_pd``) on a seeded tiny
Llama: a warm-up batch first (it pays the first connection: handshakes, UCX wiring), then the
measured batch of ``--prompts`` prompts of mixed lengths (64-400 tokens), all sent to P at once,
each sent on to D as soon as P's output is available. Per request:

* hand-off: P's output available -> D's first token (proxy hop, D's admission, the KV transfer,
  D's first decode step, and any queueing behind D's other requests);
* D TTFT: D's request submitted -> D's first token.

Every D output is checked against one engine without a connector (greedy, same prompts), and D's
``vllm:prompt_tokens_by_source`` counters show that the prompt was loaded, not recomputed. Prints a
table (p50/p99 in ms, ratios to vLLM's pull and push connectors), or JSON with ``--json``. A
connector that fails (e.g. misconfigured) gets its error in its row; the others still run.

    python benchmarks/vllm_pd.py                      # all four
    python benchmarks/vllm_pd.py --only nixl_pull --only nixl_push --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvfsm.harness.vllm_pd import (
    PdPair,
    PdRequestResult,
    make_prompts,
    make_tiny_llama,
    run_baseline,
)
from kvfsm.testing import free_port

Setup = dict[str, Any]

#: Connector rows in table order; the first two are the references for the ratios.
NAMES = ("nixl_pull", "nixl_push", "kvfsm_pull", "kvfsm_push")
REFERENCES = ("nixl_pull", "nixl_push")
_HOST = "127.0.0.1"


def _nixl(connector: str) -> Callable[[], Setup]:
    """Configs for one of vLLM's NIXL connectors: ports through the environment."""

    def build() -> Setup:
        def env() -> dict[str, str]:
            port = str(free_port())
            return {"VLLM_NIXL_SIDE_CHANNEL_HOST": _HOST, "VLLM_NIXL_SIDE_CHANNEL_PORT": port}

        return {
            "kv_transfer_config_p": {"kv_connector": connector, "kv_role": "kv_producer"},
            "kv_transfer_config_d": {"kv_connector": connector, "kv_role": "kv_consumer"},
            "env_p": env(),
            "env_d": env(),
        }

    return build


def _kvfsm(mode: str) -> Callable[[], Setup]:
    """Configs for kvfsm's connector: ports in its extra config."""

    def config(role: str) -> dict[str, Any]:
        extra = {"mode": mode, "side_channel_host": _HOST, "side_channel_port": free_port()}
        return {
            "kv_connector": "KvfsmConnector",
            "kv_connector_module_path": "kvfsm.vllm",
            "kv_role": role,
            "kv_connector_extra_config": extra,
        }

    def build() -> Setup:
        return {
            "kv_transfer_config_p": config("kv_producer"),
            "kv_transfer_config_d": config("kv_consumer"),
        }

    return build


SETUPS: dict[str, Callable[[], Setup]] = {
    "nixl_pull": _nixl("NixlConnector"),
    "nixl_push": _nixl("NixlPushConnector"),
    "kvfsm_pull": _kvfsm("pull"),
    "kvfsm_push": _kvfsm("push"),
}


def _ms(values: Sequence[float | None], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` in milliseconds (``None`` if there are none)."""
    xs = [v for v in values if v is not None]
    return float(np.percentile(np.array(xs) * 1e3, q)) if xs else None


def summarise(
    results: list[PdRequestResult], baseline: list[list[int]], external: float
) -> dict[str, Any]:
    """Percentiles, mismatches against the baseline, and errors of one measured batch."""
    handoff = [r.handoff_s for r in results]
    ttft = [r.d_ttft_s for r in results]
    mismatches = [r.rid for r, b in zip(results, baseline, strict=True) if r.token_ids != b]
    return {
        "handoff_ms_p50": _ms(handoff, 50),
        "handoff_ms_p99": _ms(handoff, 99),
        "ttft_ms_p50": _ms(ttft, 50),
        "ttft_ms_p99": _ms(ttft, 99),
        "requests": len(results),
        "mismatches": len(mismatches),
        "mismatched_rids": mismatches,
        "request_errors": [f"{r.rid}: {r.error}" for r in results if r.error],
        "external_kv_transfer_tokens": external,
        "prompt_tokens": sum(r.prompt_len for r in results),
        "error": None,
    }


def bench_one(
    name: str,
    model: Path,
    warm: list[list[int]],
    prompts: list[list[int]],
    baseline: list[list[int]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One connector: start P and D, warm up, measure; any failure becomes the row's error."""
    t0 = time.monotonic()
    try:
        with PdPair(model, log_dir=args.log_dir / name, **SETUPS[name]()) as pair:
            _progress(f"{name}: engines ready ({time.monotonic() - t0:.0f} s); warm-up")
            pair.run_batch(warm, max_tokens=args.max_tokens, rid_prefix="warm")
            before = pair.counters()[1].get("external_kv_transfer", 0.0)
            _progress(f"{name}: measuring {len(prompts)} requests")
            results = pair.run_batch(prompts, max_tokens=args.max_tokens, rid_prefix="bench")
            after = pair.counters()[1].get("external_kv_transfer", 0.0)
        row = summarise(results, baseline, after - before)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row = {"error": f"{type(exc).__name__}: {first}"[:300]}
        _progress(f"{name}: FAILED: {row['error']}")
    row["wall_s"] = time.monotonic() - t0
    _progress(f"{name}: done in {row['wall_s']:.0f} s")
    return row


def add_ratios(report: dict[str, Any]) -> None:
    """``ratio_<metric>_<name>_vs_<reference>`` for every measured row against each reference."""
    rows = report["connectors"]
    metrics = (
        ("handoff", "handoff_ms_p50"),
        ("handoff_p99", "handoff_ms_p99"),
        ("ttft", "ttft_ms_p50"),
    )
    for name, row in rows.items():
        for ref in REFERENCES:
            if ref == name or ref not in rows:
                continue
            for label, key in metrics:
                mine, theirs = row.get(key), rows[ref].get(key)
                ratio = mine / theirs if mine is not None and theirs else None
                report[f"ratio_{label}_{name}_vs_{ref}"] = ratio


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(report: dict[str, Any]) -> str:
    """The report as a fixed-width table."""
    head = (
        f"{'connector':<11} {'handoff p50':>11} {'p99':>8} {'D TTFT p50':>10} {'p99':>8} "
        f"{'vs nixl_pull':>12} {'vs nixl_push':>12}  check"
    )
    lines = [head, "-" * len(head)]
    for name, row in report["connectors"].items():
        if row.get("error"):
            lines.append(f"{name:<11} ERROR {row['error']}")
            continue
        ratios = [report.get(f"ratio_handoff_{name}_vs_{ref}") for ref in REFERENCES]
        ok = row["mismatches"] == 0 and not row["request_errors"]
        check = (
            "tokens == baseline"
            if ok
            else (f"{row['mismatches']} MISMATCHES, {len(row['request_errors'])} errors")
        )
        lines.append(
            f"{name:<11} {_fmt(row['handoff_ms_p50']):>11} {_fmt(row['handoff_ms_p99']):>8} "
            f"{_fmt(row['ttft_ms_p50']):>10} {_fmt(row['ttft_ms_p99']):>8} "
            f"{_fmt(ratios[0], '.2f'):>12} {_fmt(ratios[1], '.2f'):>12}  {check}; "
            f"D loaded {row['external_kv_transfer_tokens']:.0f}/{row['prompt_tokens']} "
            "prompt tokens"
        )
    lines.append("(milliseconds; ratios are hand-off p50 over the reference's)")
    return "\n".join(lines)


def _progress(msg: str) -> None:
    print(f"[vllm_pd {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--prompts", type=int, default=32, help="measured requests (default 32)")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up requests (default 8)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens D generates (default 4)")
    ap.add_argument("--only", action="append", choices=NAMES, help="run only this (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    ap.add_argument("--json", action="store_true", help="print a JSON object, not a table")
    ap.add_argument("--model-dir", type=Path, default=None, help="tiny model cache folder")
    ap.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: a tmp dir)")
    args = ap.parse_args(argv)
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvfsm-bench-vllm-"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if any connector that ran served a wrong token."""
    args = parse_args(argv)
    names = [n for n in NAMES if not args.only or n in args.only]
    model = make_tiny_llama(args.model_dir or Path(tempfile.gettempdir()) / "kvfsm-tiny-llama")
    warm = make_prompts(args.warmup, args.seed + 1)
    prompts = make_prompts(args.prompts, args.seed)
    _progress(f"baseline: one engine, {len(prompts)} prompts; logs in {args.log_dir}")
    baseline = run_baseline(model, prompts, args.max_tokens, log_dir=args.log_dir / "baseline")
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "warmup": len(warm),
        "max_tokens": args.max_tokens,
        "log_dir": str(args.log_dir),
        "connectors": {},
    }
    for name in names:
        report["connectors"][name] = bench_one(name, model, warm, prompts, baseline, args)
    add_ratios(report)
    print(json.dumps(report, indent=2) if args.json else table(report))
    wrong = [r for r in report["connectors"].values() if r.get("mismatches")]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
