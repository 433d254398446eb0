"""Peers and bounds over real NIXL agents and real ZMQ listeners on loopback (`open_rank`, as the
demo's rank processes build them): a shared secret on both sides serves requests; a D with
another secret is refused at the handshake; an agent that holds P's metadata but never
handshaked is not heard; and a registration naming blocks outside D's cache makes P write
nothing, fails that request alone, and P keeps serving."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvfsm.core import (
    Admit,
    Consumer,
    Finished,
    Identity,
    Mode,
    PrefillFinished,
    Producer,
    ReportFailed,
    ReportReceived,
)
from kvfsm.fabric import NixlFabric
from kvfsm.harness import Rank, open_rank
from kvfsm.layout import KvGeometry
from kvfsm.runtime import CallerOutput, KvCache
from kvfsm.sim import FAST_CONFIG, check_request, request_seed, write_request
from kvfsm.wire import Registration, encode, pack_blocks

pytestmark = pytest.mark.nixl

_HASH = "auth-test"
_GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=2, head_dim=64, dtype_bytes=2, block_size=8, num_blocks=16
)
_CONFIG = FAST_CONFIG  # failures end within seconds; a healthy hand-off takes milliseconds
_SAFETY_S = 20.0  # bounds every wait; never reached when things work
_ids = itertools.count()


class _Pair:
    """A P and a D rank on real NIXL, each with its own listener, driven by polling here."""

    def __init__(self, mode: Mode, p_secret: bytes, d_secret: bytes) -> None:
        self.mode = mode
        self.p = self._rank(Producer(Identity("P"), mode, _CONFIG), p_secret)
        self.d = self._rank(Consumer(Identity("D"), mode, _CONFIG), d_secret)
        self.p.addresses["D#0"] = ("127.0.0.1", self.d.listener.port)
        self.d.addresses["P#0"] = ("127.0.0.1", self.p.listener.port)
        self.outputs: dict[str, list[CallerOutput]] = {"P": [], "D": []}

    @staticmethod
    def _rank(core: Producer | Consumer, secret: bytes) -> Rank:
        return open_rank(core, KvCache.allocate(_GEOMETRY), compat_hash=_HASH, secret=secret)

    def pump(self, done: Callable[[], bool]) -> None:
        end = time.monotonic() + _SAFETY_S
        while not done():
            assert time.monotonic() < end, "safety bound reached"
            for side, rank in (("P", self.p), ("D", self.d)):
                rank.engine.poll()
                self.outputs[side] += rank.engine.take_outputs()

    def ended(self, side: str, rid: str) -> Finished | None:
        return next(
            (o for o in self.outputs[side] if isinstance(o, Finished) and o.request_id == rid),
            None,
        )

    def serve(self, p_blocks: list[int], d_blocks: list[int]) -> tuple[str, str]:
        """One request end to end: its final states on P and D (bytes checked if received)."""
        rid = f"req-{next(_ids)}"
        self.p.engine.submit(Admit(rid, np.array(p_blocks, np.int32)))
        self.d.engine.submit(Admit(rid, np.array(d_blocks, np.int32), "P", 1, rid))
        write_request(self.p.engine.kv, request_seed(rid), p_blocks, unit_tokens=8)
        self.p.engine.submit(PrefillFinished(rid, np.array(p_blocks, np.int32)))
        self.pump(lambda: bool(self.ended("P", rid) and self.ended("D", rid)))
        if any(isinstance(o, ReportReceived) and o.request_id == rid for o in self.outputs["D"]):
            tokens = len(p_blocks) * 8
            check = check_request(
                self.d.engine.kv,
                request_seed(rid),
                d_blocks,
                unit_tokens=8,
                first_token=0,
                tokens=tokens,
            )
            assert check.compared and not check.wrong
        p_end, d_end = self.ended("P", rid), self.ended("D", rid)
        assert p_end is not None and d_end is not None
        return p_end.state, d_end.state

    def counters(self, side: str) -> dict[str, int]:
        rank = self.p if side == "P" else self.d
        return dict(rank.engine.counters + rank.engine.side.counters)

    def close(self) -> None:
        for rank in (self.p, self.d):
            rank.engine.close()
            rank.listener.close()
            rank.directory.close()
            rank.fabric.close()


@pytest.fixture
def pairs() -> Iterator[list[_Pair]]:
    made: list[_Pair] = []
    yield made
    for pair in made:
        pair.close()


SECRET = b"the-deployment-secret-0123456789"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_engines_sharing_a_secret_serve_requests(mode: Mode, pairs: list[_Pair]) -> None:
    pair = _Pair(mode, SECRET, SECRET)
    pairs.append(pair)
    assert pair.serve([1, 2, 3], [4, 5, 6]) == ("done", "done")
    assert pair.serve([7], [9]) == ("done", "done")
    for side in ("P", "D"):
        assert not {"unauthenticated", "stranger"} & set(pair.counters(side))
    assert pair.p.listener.counters["accepted"] >= 1


def test_a_d_with_another_secret_is_refused_and_fails_cleanly(pairs: list[_Pair]) -> None:
    pair = _Pair("pull", SECRET, b"not-the-deployment-secret-000000")
    pairs.append(pair)
    p_state, d_state = pair.serve([1, 2], [3, 4])
    assert d_state == "failed" and p_state == "expired"  # P's lease ends it; nothing was read
    failed = [o for o in pair.outputs["D"] if isinstance(o, ReportFailed)]
    assert [list(o.blocks) for o in failed] == [[3, 4]]  # D's blocks reported invalid
    assert pair.p.listener.counters["unauthenticated"] >= 1
    assert pair.p.listener.counters["accepted"] == 0


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_an_agent_that_never_handshaked_is_not_heard(mode: Mode, pairs: list[_Pair]) -> None:
    pair = _Pair(mode, b"", b"")
    pairs.append(pair)
    stranger = NixlFabric("X#0")
    try:
        stranger.add_remote_agent(pair.p.fabric.get_agent_metadata())
        rid = "req-stranger"
        forged = Registration(rid, "x-00000000", 0, 1, "X", pack_blocks([0]), 1e9, "")
        pair.p.engine.submit(Admit(rid, np.array([1, 2], np.int32)))
        stranger.send_notif("P#0", encode(forged))

        def heard() -> bool:
            stranger.get_new_notifs()  # progresses its send (no NIXL progress thread here)
            return pair.counters("P").get("stranger", 0) == 1

        pair.pump(heard)
        assert rid in pair.p.engine.side.requests  # untouched: still waits for its real D
        assert not pair.p.engine.side.requests[rid].links
    finally:
        stranger.close()
    assert pair.serve([3], [4]) == ("done", "done")


@pytest.mark.parametrize("bad", [[16], [15, 40], [-1]], ids=["past-end", "one-past", "negative"])
def test_a_registration_outside_ds_blocks_writes_nothing(
    bad: list[int], pairs: list[_Pair]
) -> None:
    pair = _Pair("push", b"", b"")
    pairs.append(pair)
    assert pair.serve([1], [2]) == ("done", "done")  # D is now a known peer of P
    before = [region.copy() for region in pair.d.engine.kv.regions()]
    rid = "req-out-of-bounds"
    pair.p.engine.submit(Admit(rid, np.array([3] * len(bad), np.int32)))
    write_request(pair.p.engine.kv, request_seed(rid), [3] * len(bad), unit_tokens=8)
    pair.p.engine.submit(PrefillFinished(rid, np.array([3] * len(bad), np.int32)))
    block_ids = np.array(bad, dtype="<i4").tobytes()  # a buggy or hostile D, bypassing checks
    forged = Registration(rid, "d-0000000f", 0, 1, "D", block_ids, 1e9, "")
    pair.d.fabric.send_notif("P#0", encode(forged))
    pair.pump(lambda: pair.ended("P", rid) is not None)
    end = pair.ended("P", rid)
    assert end is not None and end.state == "failed"
    assert pair.counters("P")["post_refused"] == 1 and "posted" in pair.counters("P")
    after = pair.d.engine.kv.regions()
    assert all(np.array_equal(b, a) for b, a in zip(before, after, strict=True))
    assert pair.serve([4, 5], [6, 7]) == ("done", "done")  # P keeps serving
