"""Disaggregated serving under load: kvfsm against vLLM's NixlConnector, through the proxy.

For each connector, `vllm serve` P and D engines (`kvfsm.serving.serve`, a seeded tiny Llama) and
the project's proxy; a warm-up, then for each concurrency (1, 4, 16 requests in flight) a batch
of `--requests` prompts of 64-400 tokens, sent by a client keeping that many in flight. D
generates one token, so per request:

* TTFT: the client's request sent -> its answer (P's prefill, the hand-off, D's first token);
* hand-off: the proxy's call to D -> D's answer (`Server-Timing: decode`): D's admission, the KV
  transfer and D's first step, plus any queueing behind D's other requests;

and per batch the requests served per second. Every answer is checked against P's own greedy
token for the prompt. Prints a table with each kvfsm row's ratios to NixlConnector's at the
same concurrency, or JSON with `--json`.

Every connector runs as its users would deploy P and D on one host: each engine's worker on a
core of its own (`VLLM_CPU_OMP_THREADS_BIND`, vLLM's CPU setting; P on the first core this
process may use, D on the second; set in the environment, it wins). vLLM's default ("auto")
spreads both engines' OpenMP threads over the same cores, and their spinning barriers, beside
NIXL's busy-polling threads in NixlConnector's workers, made its prefill ~7x slower.
NixlConnector otherwise runs on its defaults (its progress thread on, as it creates its agent);
`--kvfsm-extra KEY=VALUE` adds to kvfsm's `kv_connector_extra_config` (unknown keys are refused
at start-up).

    python benchmarks/vllm_load.py                    # nixl_pull, kvfsm_pull, kvfsm_push
    python benchmarks/vllm_load.py --only kvfsm_pull --concurrency 4 --json
    python benchmarks/vllm_load.py --only kvfsm_push --kvfsm-extra poll_max_us=500
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvfsm.harness.vllm_pd import core_env, make_prompts, make_tiny_llama
from kvfsm.serving.proxy import Proxy
from kvfsm.serving.serve import Served, complete, kvfsm_transfer_config
from kvfsm.testing import free_port

NAMES = ("nixl_pull", "nixl_push", "kvfsm_pull", "kvfsm_push")
DEFAULT = ("nixl_pull", "kvfsm_pull", "kvfsm_push")
REFERENCE = "nixl_pull"
_START_S = 300.0


def _engine_specs(
    name: str, kvfsm_extra: dict[str, Any] | None = None
) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(side, `--kv-transfer-config`, environment) of P then D for connector `name`: each
    engine's worker on a core of its own unless the environment binds them."""
    specs = []
    for index, (role, side) in enumerate((("kv_producer", "p"), ("kv_consumer", "d"))):
        env: dict[str, str] = {}
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env |= core_env(index)
        if name.startswith("nixl"):
            connector = "NixlConnector" if name == "nixl_pull" else "NixlPushConnector"
            config: dict[str, Any] = {"kv_connector": connector, "kv_role": role}
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        else:
            mode = name.removeprefix("kvfsm_")
            config = kvfsm_transfer_config(role, mode, free_port(), **(kvfsm_extra or {}))
        specs.append((side, config, env))
    return specs


def _engines(
    name: str, model: Path, logs: Path, kvfsm_extra: dict[str, Any] | None = None
) -> tuple[Served, Served]:
    """P and D for connector `name`, started (not yet ready)."""
    p, d = (
        Served(model, free_port(), logs / f"{name}-{side}.log", config, env=env)
        for side, config, env in _engine_specs(name, kvfsm_extra)
    )
    return p, d


def _extra_setting(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of `--kvfsm-extra`: VALUE as JSON where it parses (numbers, true, null),
    else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _request(proxy: str, prompt: list[int]) -> tuple[float, float, list[int]]:
    """One completion through the proxy: (TTFT s, hand-off s, token ids)."""
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://{proxy}/v1/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as answer:
        result = json.loads(answer.read())
        timing = answer.headers.get("Server-Timing", "")
    ttft = time.perf_counter() - t0
    parts = dict(p.strip().split(";dur=") for p in timing.split(",") if ";dur=" in p)
    return ttft, float(parts.get("decode", "nan")) / 1e3, result["choices"][0]["token_ids"]


def _batch(
    proxy: str, prompts: list[list[int]], expected: list[list[int]], n: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda x: _request(proxy, x), prompts))
    wall = time.perf_counter() - t0
    ttft = np.array([r[0] for r in results]) * 1e3
    handoff = np.array([r[1] for r in results]) * 1e3
    return {
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "ttft_ms_max": float(ttft.max()),
        "ttft_ms_by_request": [round(float(t), 1) for t in ttft],
        "handoff_ms_p50": float(np.percentile(handoff, 50)),
        "handoff_ms_p99": float(np.percentile(handoff, 99)),
        "requests_per_s": len(prompts) / wall,
        "mismatches": sum(r[2] != e for r, e in zip(results, expected, strict=True)),
    }


def bench_one(name: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start one connector's engines and proxy, warm up, sweep the concurrencies."""
    t0 = time.monotonic()
    p, d = _engines(name, model, args.log_dir, dict(args.kvfsm_extra or ()))
    proxy = None
    try:
        until = time.monotonic() + _START_S
        p.wait_ready(until)
        d.wait_ready(until)
        proxy = Proxy(0, [p.address], [d.address]).start()
        address = f"127.0.0.1:{proxy.port}"
        _progress(f"{name}: engines ready ({time.monotonic() - t0:.0f} s); warm-up")
        expected = [complete(p.address, x, 1)["choices"][0]["token_ids"] for x in args.prompts]
        _batch(
            address,
            args.warm,
            [complete(p.address, x, 1)["choices"][0]["token_ids"] for x in args.warm],
            4,
        )
        rows = {}
        for n in args.concurrency:
            _progress(f"{name}: {len(args.prompts)} requests, {n} in flight")
            rows[str(n)] = _batch(address, args.prompts, expected, n)
        return {"by_concurrency": rows, "error": None}
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        _progress(f"{name}: FAILED: {type(exc).__name__}: {first} (logs: {args.log_dir})")
        return {"by_concurrency": {}, "error": f"{type(exc).__name__}: {first}"[:300]}
    finally:
        if proxy is not None:
            proxy.close()
        d.close()
        p.close()


def add_ratios(report: dict[str, Any]) -> None:
    """Each row's metrics over NixlConnector's at the same concurrency (`ratio_<metric>`)."""
    reference = report["connectors"].get(REFERENCE, {}).get("by_concurrency", {})
    for row in report["connectors"].values():
        for n, cell in row["by_concurrency"].items():
            ref = reference.get(n)
            for key in (
                "ttft_ms_p50",
                "ttft_ms_p99",
                "handoff_ms_p50",
                "handoff_ms_p99",
                "requests_per_s",
            ):
                cell[f"ratio_{key}"] = cell[key] / ref[key] if ref and ref[key] else None


def table(report: dict[str, Any]) -> str:
    """The report as a fixed-width table (ratios: this row over NixlConnector's)."""
    head = (
        f"{'connector':<11} {'in flight':>9} {'TTFT p50':>9} {'p99':>8} {'hand-off p50':>12}"
        f" {'p99':>8} {'req/s':>7} {'ratio TTFT p50/p99':>19} {'hand-off p50/p99':>17}"
        f" {'req/s':>6}"
    )
    lines = [head, "-" * len(head)]

    def r(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for name, row in report["connectors"].items():
        if row["error"]:
            lines.append(f"{name:<11} ERROR {row['error']}")
        for n, c in row["by_concurrency"].items():
            bad = f"  {c['mismatches']} MISMATCHES" if c["mismatches"] else ""
            lines.append(
                f"{name:<11} {n:>9} {c['ttft_ms_p50']:>9.1f} {c['ttft_ms_p99']:>8.1f}"
                f" {c['handoff_ms_p50']:>12.1f} {c['handoff_ms_p99']:>8.1f}"
                f" {c['requests_per_s']:>7.1f}"
                f" {r(c['ratio_ttft_ms_p50']) + ' / ' + r(c['ratio_ttft_ms_p99']):>19}"
                f" {r(c['ratio_handoff_ms_p50']) + ' / ' + r(c['ratio_handoff_ms_p99']):>17}"
                f" {r(c['ratio_requests_per_s']):>6}{bad}"
            )
    lines.append("(milliseconds; ratios are this row over nixl_pull's at the same concurrency)")
    return "\n".join(lines)


def _progress(msg: str) -> None:
    print(f"[vllm_load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; exit status 1 if any answer differed from P's own token."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=32, help="requests per batch (default 32)")
    ap.add_argument("--concurrency", type=int, action="append", help="in flight (1, 4, 16)")
    ap.add_argument("--only", action="append", choices=NAMES, help="run only this (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    ap.add_argument("--json", action="store_true", help="print a JSON object, not a table")
    ap.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: a tmp dir)")
    ap.add_argument(
        "--kvfsm-extra",
        type=_extra_setting,
        action="append",
        metavar="KEY=VALUE",
        help="a kvfsm kv_connector_extra_config setting for the kvfsm_* variants (repeatable)",
    )
    args = ap.parse_args(argv)
    args.concurrency = args.concurrency or [1, 4, 16]
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvfsm-bench-load-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.prompts = make_prompts(args.requests, args.seed)
    args.warm = make_prompts(8, args.seed + 1)
    model = make_tiny_llama(Path(tempfile.gettempdir()) / "kvfsm-tiny-llama")
    report: dict[str, Any] = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "log_dir": str(args.log_dir),
        "kvfsm_extra": dict(args.kvfsm_extra or ()),
        "connectors": {},
    }
    for name in args.only or DEFAULT:
        report["connectors"][name] = bench_one(name, model, args)
    add_ratios(report)
    print(json.dumps(report, indent=2) if args.json else table(report))
    rows = report["connectors"].values()
    return 1 if any(c["mismatches"] for r in rows for c in r["by_concurrency"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
