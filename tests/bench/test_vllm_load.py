"""benchmarks/vllm_load.py's report: each row's ratios over NixlConnector's at the same
concurrency, and wrong tokens flagged in the table (the sweep itself needs `vllm serve`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vllm_load  # a script: on the path above


def _cell(ms: float, rate: float, mismatches: int = 0) -> dict[str, Any]:
    keys = ("ttft_ms_p50", "ttft_ms_p99", "handoff_ms_p50", "handoff_ms_p99")
    return dict.fromkeys(keys, ms) | {"requests_per_s": rate, "mismatches": mismatches}


def test_ratios_are_over_nixl_at_the_same_concurrency() -> None:
    report: dict[str, Any] = {
        "connectors": {
            "nixl_pull": {
                "error": None,
                "by_concurrency": {"1": _cell(100, 2), "4": _cell(400, 4)},
            },
            "kvfsm_pull": {
                "error": None,
                "by_concurrency": {"1": _cell(25, 8), "4": _cell(40, 5, 1)},
            },
            "kvfsm_push": {"error": "ServeError: down", "by_concurrency": {}},
        }
    }
    vllm_load.add_ratios(report)
    one, four = (report["connectors"]["kvfsm_pull"]["by_concurrency"][n] for n in ("1", "4"))
    assert one["ratio_ttft_ms_p50"] == 0.25 and one["ratio_requests_per_s"] == 4
    assert four["ratio_handoff_ms_p99"] == 0.1
    text = vllm_load.table(report)
    assert "1 MISMATCHES" in text and "kvfsm_push  ERROR ServeError: down" in text


def test_kvfsm_extra_reaches_only_kvfsm_and_each_engine_gets_a_core(monkeypatch: Any) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    args = argparse.ArgumentParser()
    args.add_argument("--kvfsm-extra", type=vllm_load._extra_setting, action="append")
    given = args.parse_args(["--kvfsm-extra", "poll_max_us=500", "--kvfsm-extra", "mode_x=a=b"])
    extra = dict(given.kvfsm_extra)
    assert extra == {"poll_max_us": 500, "mode_x": "a=b"}
    (_, p, p_env), (_, d, d_env) = vllm_load._engine_specs("kvfsm_push", extra)
    assert p["kv_connector_extra_config"]["poll_max_us"] == 500
    assert d["kv_connector_extra_config"]["mode"] == "push"
    assert p_env["VLLM_CPU_OMP_THREADS_BIND"] != d_env["VLLM_CPU_OMP_THREADS_BIND"] or (
        len(os.sched_getaffinity(0)) == 1
    )
    (_, nixl, _), _ = vllm_load._engine_specs("nixl_pull", extra)
    assert "kv_connector_extra_config" not in nixl
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    (_, _, env), _ = vllm_load._engine_specs("nixl_pull")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # the environment's binding wins


def test_kvfsm_extra_needs_key_and_value() -> None:
    for bad in ("poll_max_us", "=3"):
        try:
            vllm_load._extra_setting(bad)
        except argparse.ArgumentTypeError:
            continue
        raise AssertionError(f"{bad!r} accepted")
