"""Load on the side channel from another process: while a second process on loopback keeps 200
handshakes open at once and floods the listener with thousands of hostile requests (garbage,
wrong frame counts, oversized frames, unknown agents, mismatches, a failing lookup, frames past
ZMQ's hard limit), this process's own handshakes get the right payloads, every valid handshake of
the flood does too, every hostile message gets the refusal its kind calls for, the listener's
counters add up exactly, and its thread is alive and serving afterwards. Bounded in count and
time; no timing assertions (figures belong in benchmarks)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvfsm.sidechannel import HandshakeListener, HandshakePayload, fetch_peer
from tests.fuzz.handshake_peers import HASH, HOST, PAYLOADS, SAFETY_S, WIRE, lookup

_REPO = Path(__file__).resolve().parents[2]
SPEC = {
    "valid": 200,  # REQ sockets, all waiting for their answer at once
    "dealers": 16,
    "messages": 6000,  # hostile requests of every kind
    "oversized": 12,  # and twice as many over the size limit (one frame, or two summed)
    "giant": 2,  # frames past ZMQ_MAXMSGSIZE: dropped by libzmq, never counted
    "window": 32,  # unanswered requests per DEALER at most (replies are not dropped)
    "seed": 7,
    "deadline_s": 120,  # the flood gives up (and reports what is missing) after this
}
OURS = 48  # handshakes this process makes while the flood runs


def _fetch(port: int, i: int) -> HandshakePayload:
    agent = f"prefill#{i % 2}"
    return fetch_peer(HOST, port, agent, compat_hash=HASH, wire_version=WIRE, timeout_s=SAFETY_S)[0]


def test_listener_under_a_flood_from_another_process() -> None:
    with HandshakeListener(lookup) as listener:
        flood = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.fuzz.flood_listener",
                str(listener.port),
                json.dumps(SPEC),
            ],
            cwd=_REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert flood.stdout is not None and flood.stderr is not None
            # The flood's valid handshakes are out; ours run while its hostile part goes on.
            if flood.stdout.readline().strip() != "flooding":
                flood.kill()
                pytest.fail(f"the flood process failed: {flood.stderr.read()}")
            with ThreadPoolExecutor(8) as pool:
                ours = list(pool.map(lambda i: _fetch(listener.port, i), range(OURS)))
            out, err = flood.communicate(timeout=SPEC["deadline_s"] + 60)
        finally:
            flood.kill()  # a no-op once it has exited
        assert flood.returncode == 0, err
        report = json.loads(out)
        # Every answer came, and each was what the listener's contract says for its request.
        assert report["missing"] == 0 and report["wrong"] == []
        assert report["valid_ok"] == SPEC["valid"]
        assert ours == [PAYLOADS[f"prefill#{i % 2}"] for i in range(OURS)]
        # The counters add up exactly: the flood's, plus ours; the giant frames count nothing.
        expected = Counter(report["expected"]) + Counter({"accepted": OURS})
        assert expected["accepted"] == SPEC["valid"] + OURS
        assert expected["oversized"] == 2 * SPEC["oversized"]
        assert expected["malformed"] > SPEC["messages"] // 2
        assert {"refused", "errors"} <= set(expected)
        assert Counter(listener.counters) == expected
        # Alive and serving after the flood.
        assert listener.thread.is_alive()
        assert _fetch(listener.port, 0) == PAYLOADS["prefill#0"]
