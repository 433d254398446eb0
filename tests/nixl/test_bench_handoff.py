"""`kvfsm._bench_handoff` runs both loops over real NIXL and reports every request received
(its figures are printed, never asserted)."""

from __future__ import annotations

import json

from kvfsm._bench_handoff import LOOPS, bench_handoff


def test_the_benchmark_reports_both_loops_and_every_request_received() -> None:
    out = bench_handoff("pull", 5, model="tiny", max_blocks=2)
    json.dumps(out)  # JSON-able, as `--json` prints it
    for loop in LOOPS:
        assert out[f"received_{loop}"] == out[f"done_{loop}"] == 5
        assert out[f"bytes_checked_{loop}"] > 0 and out[f"bytes_wrong_{loop}"] == 0
        assert out[f"errors_{loop}"] == []
        assert 0 < out[f"handoff_{loop}_ms_p50"] <= out[f"handoff_{loop}_ms_p99"]
    assert out["ratio_event_poll1ms"] > 0
