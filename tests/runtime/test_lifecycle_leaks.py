"""Engine start/stop over real NIXL leaks nothing: after each of 100 cycles (two engines, a
handshake, a transfer, shutdown) every handle, list, remote agent and registration is released."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from kvfsm.core import Admit, Consumer, Finished, Identity, PrefillFinished, Producer, Shutdown
from kvfsm.fabric import NixlFabric
from kvfsm.layout import KvGeometry
from kvfsm.runtime import Engine, KvCache
from kvfsm.sidechannel import LocalDirectory

pytestmark = pytest.mark.nixl

_GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=2, head_dim=64, dtype_bytes=2, block_size=8, num_blocks=4
)
_names = itertools.count()


def _cycle(n: int) -> list[dict[str, int]]:
    directory = LocalDirectory(time.monotonic)
    engines = []
    for side in (Producer(Identity(f"P{n}"), "push"), Consumer(Identity(f"D{n}"), "push")):
        fabric = NixlFabric(side.identity.agent)
        engine = Engine(side, fabric, KvCache.allocate(_GEOMETRY), directory.view(), time.monotonic)
        directory.publish(engine.agent, engine.info)
        engines.append(engine)
    p, d = engines
    blocks = np.array([1, 2], dtype=np.int32)
    p.submit(Admit("r-0000000a", blocks))
    p.submit(PrefillFinished("r-0000000a", blocks))
    d.submit(Admit("r-0000000b", blocks, f"P{n}", 1, ""))
    ended: list[str] = []
    deadline = time.monotonic() + 20
    while len(ended) < 2 and time.monotonic() < deadline:
        for engine in engines:
            engine.poll()
            ended += [o.state for o in engine.take_outputs() if isinstance(o, Finished)]
    assert sorted(ended) == ["done", "done"]
    leftovers = []
    for engine in engines:
        engine.submit(Shutdown())
        engine.close()
        leftovers.append(engine.fabric.open_resources())  # type: ignore[attr-defined]
        engine.fabric.close()
    return leftovers


def test_one_hundred_start_stop_cycles_leave_nothing_open() -> None:
    for n in range(100):
        leftovers = _cycle(next(_names))
        assert all(not any(counts.values()) for counts in leftovers), (n, leftovers)
