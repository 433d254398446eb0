"""benchmarks/vllm_load.py's report: each row's ratios over NixlConnector's at the same
concurrency, and wrong tokens flagged in the table (the sweep itself needs `vllm serve`)."""

from __future__ import annotations

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
