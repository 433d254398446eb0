"""The other process of test_sidechannel_load.py: floods a `HandshakeListener` on loopback.

    python -m tests.fuzz.flood_listener PORT SPEC_JSON

Opens `valid` REQ sockets that each ask for a served agent (all outstanding at once), and
`dealers` DEALER sockets that send `messages` hostile requests (garbage, wrong frame counts,
mutated, unknown agents, mismatched hashes and versions, the failing lookup, `oversized` frames
over the size limit), at most `window` unanswered per socket; plus `giant` frames beyond ZMQ's
hard limit on a socket of their own (the listener drops those connections, counting nothing).
Prints "flooding" once the valid handshakes are out, then one JSON report: what the listener
must have counted, how many valid handshakes got the right payload, every reply that was not
what the listener's contract says (first 10), and how many answers never came (it gives up at
`deadline_s`)."""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import zmq

from kvfsm.sidechannel import (
    MAX_HANDSHAKE_BYTES,
    HandshakeAccepted,
    HandshakeRefused,
    decode_reply,
)
from tests.fuzz.handshake_peers import BOOM, HOST, PAYLOADS, expected_outcome, request

REASONS = {
    "oversized": ("oversized request",),
    "malformed": ("malformed request", "not a kvfsm handshake frame"),
    "refused": ("no agent", "mismatch"),
    "errors": ("lookup exploded",),
}
"""What a refusal of each outcome says."""


def hostile(rng: random.Random, i: int) -> list[bytes]:
    """The `i`th hostile message: every kind in turn, random within its kind."""
    junk = rng.randbytes(rng.randint(0, 64))
    valid = request(f"prefill#{i % 2}")
    flipped = bytearray(valid)
    flipped[rng.randrange(len(flipped))] = rng.randrange(256)
    kinds: list[list[bytes]] = [
        [junk],
        [b"kvhs1" + junk],
        [bytes(flipped)],
        [valid, junk],  # two frames
        [valid, valid, valid],
        [b"", junk],  # REQ-style framing
        [b""],
        [request(f"decode#{i}")],
        [request("prefill#0", hash_="0" * 64)],
        [request("prefill#1", wire_version=99)],
        [request(BOOM)],
        [request("")],
    ]
    return kinds[i % len(kinds)]


@dataclass
class Flood:
    """Every socket and what it still waits for."""

    port: int
    spec: dict[str, int]
    ctx: zmq.Context[zmq.Socket[bytes]] = field(default_factory=zmq.Context)
    expected: Counter[str] = field(default_factory=Counter)
    waiting: dict[zmq.Socket[bytes], deque[tuple[str, str]]] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)
    valid_ok: int = 0

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{self.port}")
        self.waiting[sock] = deque()
        return sock

    def send(self, sock: zmq.Socket[bytes], frames: list[bytes], agent: str = "") -> None:
        outcome = expected_outcome(frames)
        self.expected[outcome] += 1
        self.waiting[sock].append((outcome, agent))
        sock.send_multipart(frames)

    def receive(self, sock: zmq.Socket[bytes]) -> None:
        outcome, agent = self.waiting[sock].popleft()
        reply = decode_reply(sock.recv_multipart()[-1])
        if outcome == "accepted":
            good = isinstance(reply, HandshakeAccepted) and reply.payload == PAYLOADS[agent]
            self.valid_ok += good
        else:
            good = isinstance(reply, HandshakeRefused) and any(
                text in reply.reason for text in REASONS[outcome]
            )
        if not good and len(self.wrong) < 10:
            self.wrong.append(f"{outcome}: {reply!r:.200}")

    def outstanding(self) -> int:
        return sum(len(q) for q in self.waiting.values())


def run(flood: Flood) -> dict[str, object]:
    """Send everything, collect every answer (until the deadline); the report."""
    spec = flood.spec
    rng = random.Random(spec["seed"])
    deadline = time.monotonic() + spec["deadline_s"]
    for i in range(spec["valid"]):
        agent = f"prefill#{i % 2}"
        flood.send(flood.socket(zmq.REQ), [request(agent)], agent)
    print("flooding", flush=True)
    giant = flood.socket(zmq.DEALER)
    for _ in range(spec["giant"]):  # no answer expected: not waited for
        giant.send(b"g" * (3 * MAX_HANDSHAKE_BYTES))
    del flood.waiting[giant]
    dealers = [flood.socket(zmq.DEALER) for _ in range(spec["dealers"])]
    plan = [hostile(rng, i) for i in range(spec["messages"])]
    plan += [[b"x" * (MAX_HANDSHAKE_BYTES + 1)]] * spec["oversized"]
    plan += [[b"y" * (MAX_HANDSHAKE_BYTES // 2 + 1)] * 2] * spec["oversized"]  # summed
    rng.shuffle(plan)
    poller = zmq.Poller()
    for sock in flood.waiting:
        poller.register(sock, zmq.POLLIN)
    while (plan or flood.outstanding()) and time.monotonic() < deadline:
        for sock in dealers:
            while plan and len(flood.waiting[sock]) < spec["window"]:
                flood.send(sock, plan.pop())
        for sock, _ in poller.poll(100):
            while flood.waiting[sock] and sock.poll(0):
                flood.receive(sock)
    return {
        "expected": dict(flood.expected),
        "valid_ok": flood.valid_ok,
        "wrong": flood.wrong,
        "missing": flood.outstanding() + len(plan),
    }


def main() -> None:
    """Flood the listener at argv[1] as argv[2] (JSON) says; print the report."""
    flood = Flood(int(sys.argv[1]), json.loads(sys.argv[2]))
    try:
        report = run(flood)
    finally:
        flood.ctx.destroy(linger=0)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
