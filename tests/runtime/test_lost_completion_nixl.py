"""A lost completion over real NIXL agents and real ZMQ side channels (`open_rank`, with a shared
secret): the side that did not hear the completion asks its peer at the peer's listener, which
answers from its engine's loop, and the request ends `done` with every byte checked. With the
answering side's listener not answering, the request ends as it did before: never `done` on a
guess."""

from __future__ import annotations

import itertools
import queue
from collections.abc import Iterator
from typing import cast

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
    ReportReceived,
)
from kvfsm.fabric import Fabric
from kvfsm.harness import Rank, close_rank, open_rank
from kvfsm.layout import KvGeometry
from kvfsm.runtime import CallerOutput, EngineLoop, KvCache, status_answerer
from kvfsm.sim import FAST_CONFIG, LossyInbox, check_request, request_seed, write_request

pytestmark = pytest.mark.nixl

_GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=2, head_dim=64, dtype_bytes=2, block_size=8, num_blocks=16
)
_SECRET = b"the-deployment-secret-0123456789"
_SAFETY_S = 30.0  # bounds every wait; a recovery takes FAST_CONFIG's watchdog at most
_ids = itertools.count()


class _Side:
    """One rank on its own engine loop, answering questions at its listener."""

    def __init__(self, core: Producer | Consumer) -> None:
        kv = KvCache.allocate(_GEOMETRY)
        self.rank: Rank = open_rank(core, kv, compat_hash="lost-test", secret=_SECRET)
        self.outputs: queue.SimpleQueue[CallerOutput] = queue.SimpleQueue()
        self.loop = EngineLoop(self.rank.engine, self.outputs.put)
        self.rank.directory.on_result = self.loop.wake
        self.rank.listener.status = status_answerer(self.loop)
        self.inbox = LossyInbox(self.rank.engine.fabric, self.rank.engine.clock)
        self.rank.engine.fabric = cast(Fabric, self.inbox)
        self.seen: list[CallerOutput] = []

    def finished(self, rid: str) -> Finished:
        while True:
            found = [o for o in self.seen if isinstance(o, Finished) and o.request_id == rid]
            if found:
                return found[0]
            self.seen.append(self.outputs.get(timeout=_SAFETY_S))

    def counters(self) -> dict[str, int]:
        engine = self.rank.engine
        counts: dict[str, int] = self.loop.call(lambda e: dict(e.side.counters)).result(5)
        return counts | {"lost": engine.fabric.lost}  # type: ignore[attr-defined]


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[_Side, _Side]]:
    mode: Mode = request.param
    p = _Side(Producer(Identity("P"), mode, FAST_CONFIG))
    d = _Side(Consumer(Identity("D"), mode, FAST_CONFIG))
    p.rank.addresses["D#0"] = ("127.0.0.1", d.rank.listener.port)
    d.rank.addresses["P#0"] = ("127.0.0.1", p.rank.listener.port)
    for side in (p, d):
        side.loop.start()
    yield p, d
    for side in (p, d):
        close_rank(side.rank, side.loop)


def _serve(p: _Side, d: _Side, blocks: list[int]) -> tuple[str, str, str]:
    rid = f"req-{next(_ids)}"
    ids = np.array(blocks, np.int32)
    p.loop.submit(Admit(rid, ids)).result(5)
    d.loop.submit(Admit(rid, ids, "P", 1, rid)).result(5)
    write_request(p.rank.engine.kv, request_seed(rid), blocks, unit_tokens=8)
    p.loop.submit(PrefillFinished(rid, ids)).result(5)
    p_end, d_end = p.finished(rid), d.finished(rid)
    if any(isinstance(o, ReportReceived) and o.request_id == rid for o in d.seen):
        check = check_request(
            d.rank.engine.kv,
            request_seed(rid),
            blocks,
            unit_tokens=8,
            first_token=0,
            tokens=len(blocks) * 8,
        )
        assert check.compared and not check.wrong
    return rid, p_end.state, d_end.state


@pytest.mark.parametrize("pair", ["push", "pull"], indirect=True)
def test_a_lost_completion_is_recovered_by_asking_the_peer(pair: tuple[_Side, _Side]) -> None:
    p, d = pair
    mode = p.rank.engine.side.mode
    asker, answerer = (d, p) if mode == "push" else (p, d)
    asker.inbox.lose_next("done")
    _, p_state, d_state = _serve(p, d, [1, 2, 3])
    assert (p_state, d_state) == ("done", "done")
    counts = asker.counters()
    assert counts["lost"] == 1 and counts["recovered"] == 1 and counts["status_done"] == 1
    assert answerer.rank.listener.counters["status_answered"] == 1


@pytest.mark.parametrize("pair", ["push", "pull"], indirect=True)
def test_with_no_answer_a_lost_completion_is_never_done(pair: tuple[_Side, _Side]) -> None:
    p, d = pair
    mode = p.rank.engine.side.mode
    asker, answerer = (d, p) if mode == "push" else (p, d)
    answerer.rank.listener.status = None  # the question reaches nobody who can answer
    asker.inbox.lose_next("done")
    _, p_state, d_state = _serve(p, d, [4, 5])
    if mode == "push":
        assert p_state == "done" and d_state in ("failed", "expired")  # D reports them invalid
    else:
        assert d_state == "done" and p_state == "failed"  # P's stall bound ends its wait
    counts = asker.counters()
    assert counts["status_unanswered"] == 1 and "recovered" not in counts
