"""P and D in separate processes (one per TP rank) over real NIXL, handshakes over ZMQ on loopback,
every byte checked: the TP pairs, replicated (MLA) KV and a P block size smaller than D's, in push
and pull; and `kvfsm demo` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfsm.cli.demo._nixl import run_nixl_demo
from kvfsm.core import Mode

pytestmark = pytest.mark.nixl

# (mode, P TP, D TP, model, P block size, D block size). Each mode meets more P ranks than D and
# fewer, replicated KV and bigger D blocks. The rows of every TP pair and block ratio are checked
# byte for byte in tests/layout, and both modes run TP mismatches, MLA and bigger D blocks on
# the simulated fabric (tests/stateful): on real NIXL each setup runs in one mode, 1 -> 1 in both.
_SETUPS: list[tuple[Mode, int, int, str, int, int]] = [
    ("push", 1, 1, "tiny", 16, 16),
    ("pull", 1, 1, "tiny", 16, 16),
    ("pull", 2, 1, "tiny", 16, 16),
    ("push", 1, 2, "tiny", 16, 16),
    ("pull", 2, 4, "tiny", 16, 16),  # several ranks on both sides
    ("push", 2, 1, "deepseek-v2-lite", 16, 16),  # replicated KV: D receives one copy
    ("pull", 1, 2, "deepseek-v2-lite", 16, 16),  # replicated KV: every D rank reads a whole copy
    ("push", 1, 1, "tiny", 16, 32),  # P's blocks half the size of D's
    ("pull", 2, 1, "tiny", 8, 32),
]
_REQUESTS = 12


@pytest.mark.parametrize(
    ("mode", "p_tp", "d_tp", "model", "p_bs", "d_bs"),
    _SETUPS,
    ids=[f"{m}-tp{p}to{d}-bs{pb}to{db}-{mode}" for mode, p, d, m, pb, db in _SETUPS],
)
def test_separate_processes_move_verified_kv(
    mode: Mode, p_tp: int, d_tp: int, model: str, p_bs: int, d_bs: int
) -> None:
    report = run_nixl_demo(
        mode,
        _REQUESTS,
        seed=p_tp * 10 + d_tp,
        p_tp=p_tp,
        d_tp=d_tp,
        model=model,
        p_block_size=p_bs,
        d_block_size=d_bs,
        memory_mib=8,
    )
    assert report.violations == []
    assert report.requests == report.done == _REQUESTS and report.verified
    assert report.finals == {"P:done": _REQUESTS * p_tp, "D:done": _REQUESTS * d_tp}
    assert report.bytes > 0 and report.handoff_ms_p99 >= report.handoff_ms_p50 > 0
    # Which ranks post: every rank pair that shares heads moves its slice once; with replicated
    # KV each D rank gets exactly one copy and the other P ranks only send a notification.
    pairs = d_tp if model == "deepseek-v2-lite" else max(p_tp, d_tp)
    assert report.counters["posted"] == _REQUESTS * pairs
    assert report.descriptors == report.counters["descriptors"] > 0


def test_cli_default_is_the_real_fabric() -> None:
    exe = Path(sys.executable).parent / "kvfsm"
    result = subprocess.run(
        [str(exe), "demo", "--requests", "6", "--memory-mib", "32", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["fabric"] == "nixl" and report["model"] == "llama3-8b"
    assert report["done"] == 6 and report["verified"] is True
    assert {"gbps", "handoff_ms_p50", "handoff_ms_p99"} <= report.keys()


def test_json_output_stays_json_when_ucx_warns() -> None:
    # UCX prints a warning for each UCX_ variable it does not know, from native code and from
    # every child process, on file descriptor 1: with --json only the report may reach stdout.
    exe = Path(sys.executable).parent / "kvfsm"
    result = subprocess.run(
        [str(exe), "demo", "--requests", "2", "--memory-mib", "16", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=os.environ | {"UCX_KVFSM_NOT_A_SETTING": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "UCX_KVFSM_NOT_A_SETTING" in result.stderr  # the warning went to stderr instead
    assert json.loads(result.stdout)["done"] == 2


# The README's examples under load, as a user runs them: the demo always runs with a shared
# secret, so every notification is sealed and guarded against replays (docs/security.md).
_LOADS = [
    ["--p-tp", "2", "--d-tp", "4", "--model", "tiny", "--requests", "256"],
    ["--model", "tiny", "--requests", "256"],
    ["--mode", "pull", "--p-tp", "2", "--d-tp", "4", "--model", "tiny", "--requests", "256"],
    ["--p-tp", "2", "--d-tp", "4", "--requests", "200"],
    ["--mode", "pull", "--requests", "200"],
]


@pytest.mark.parametrize("args", _LOADS, ids=" ".join)
def test_readme_examples_under_load_end_every_request_done(args: list[str]) -> None:
    exe = Path(sys.executable).parent / "kvfsm"
    result = subprocess.run(
        [str(exe), "demo", *args, "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    requests = int(args[args.index("--requests") + 1])
    assert report["done"] == requests and report["verified"] is True
    assert report["finals"] == {
        "P:done": requests * report["p_tp"],
        "D:done": requests * report["d_tp"],
    }
    assert report["counters"].get("replayed", 0) == 0 and report["why_not_done"] == []


def test_a_corrupted_byte_is_caught_and_fails_the_run() -> None:
    # The negative control: every transfer succeeds, but one request's KV has one wrong byte.
    # Pull here; the command line's test below runs it in push.
    report = run_nixl_demo("pull", 6, seed=3, d_tp=2, model="tiny", memory_mib=8, corrupt=1)
    assert report.done == 6 and not report.verified and not report.ok
    assert report.violations == ["1 bytes differ from what P wrote"]


def test_cli_exits_1_when_bytes_differ() -> None:
    exe = Path(sys.executable).parent / "kvfsm"
    result = subprocess.run(
        [
            str(exe),
            "demo",
            "--requests",
            "4",
            "--model",
            "tiny",
            "--memory-mib",
            "8",
            "--corrupt",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["mode"] == "push" and report["verified"] is False and report["done"] == 4
    assert report["violations"] == ["2 bytes differ from what P wrote"]
    assert "kvfsm demo: not every byte was verified equal" in result.stderr
    assert report["why_not_done"] == ["not every byte was verified equal", "1 safety violation(s)"]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_with_verify_a_byte_flipped_after_the_checksum_fails_its_request(mode: str) -> None:
    """`--verify all --corrupt 2`: the bytes go out wrong after P's checksum, D's check fails
    those two requests (blocks invalid, `corrupted` 2) and every byte D reported received is
    right."""
    exe = Path(sys.executable).parent / "kvfsm"
    args = ["demo", "--mode", mode, "--requests", "6", "--model", "tiny", "--memory-mib", "8"]
    result = subprocess.run(
        [str(exe), *args, "--verify", "all", "--corrupt", "2", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["done"] == 4 and report["failed"] == 2 and report["verified"] is True
    assert report["counters"]["corrupted"] == 2 and report["counters"]["verified"] == 4
    assert report["violations"] == []


def test_cli_refuses_a_tp_size_that_does_not_split_the_heads() -> None:
    exe = Path(sys.executable).parent / "kvfsm"
    result = subprocess.run(
        [str(exe), "demo", "--model", "tiny", "--d-tp", "3", "--requests", "1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 2
    assert "num_kv_heads=8 is not divisible by tp_size=3" in result.stderr
