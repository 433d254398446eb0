"""The same script of operations on SimFabric and on real NIXL ends in the same final states with
the same bytes: the simulated fabric the stateful suite trusts behaves like the real one for the
operations both support (no injected faults: the real fabric cannot be told to drop a message)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvfsm.core import (
    Abort,
    Admit,
    Consumer,
    Finished,
    Identity,
    Mode,
    PrefillFinished,
    Producer,
    ReportReceived,
)
from kvfsm.fabric import Fabric, NixlFabric, SimNetwork
from kvfsm.layout import KvGeometry
from kvfsm.runtime import Engine, KvCache, LocalDirectory
from kvfsm.testing import request_seed, write_request

_GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=2, block_size=4, num_blocks=32
)
_names = itertools.count()

# (key, P blocks, D blocks, what happens): D blocks fewer than P's = a partial prefix-cache hit.
_SCRIPT = [
    ("plain", [1, 2, 3], [4, 5, 6], "run"),
    ("partial-hit", [7, 8, 9], [10], "run"),
    ("full-hit", [11, 12], [], "run"),
    ("no-kv", [], [], "run"),
    ("p-abort", [13, 14], [15, 16], "abort P before the prefill ends"),
    ("d-abort", [17], [18], "abort D before it registers"),
]


class _World:
    """Two engines on one kind of fabric, and a way to let time pass."""

    def __init__(self, mode: Mode, fabric: str) -> None:
        n = next(_names)
        self.p_name = f"P{n}"
        if fabric == "sim":
            net = SimNetwork(0)
            clock: Callable[[], float] = lambda: net.now  # noqa: E731
            make: Callable[[str], Fabric] = net.agent
            self.tick: Callable[[], None] = lambda: net.advance(1e-3)
        else:
            clock, make, self.tick = time.monotonic, NixlFabric, lambda: None
        directory = LocalDirectory(clock)
        self.engines: list[Engine] = []
        for side in (Producer(Identity(self.p_name), mode), Consumer(Identity(f"D{n}"), mode)):
            kv = KvCache.allocate(_GEOMETRY)
            engine = Engine(side, make(side.identity.agent), kv, directory.view(), clock)
            directory.publish(engine.agent, engine.info)
            self.engines.append(engine)
        self.finals: dict[str, str] = {}
        self.received: dict[str, bytes] = {}

    def settle(self, ids: set[str], limit: float = 20.0) -> None:
        deadline = time.monotonic() + limit
        while not ids <= self.finals.keys():
            assert time.monotonic() < deadline, f"not ended: {ids - self.finals.keys()}"
            self.tick()
            for engine in self.engines:
                engine.poll()
                for out in engine.take_outputs():
                    if isinstance(out, Finished):
                        self.finals[out.request_id] = out.state
                    elif isinstance(out, ReportReceived):
                        regions = engine.kv.regions()
                        g = engine.kv.geometry
                        self.received[out.request_id] = b"".join(
                            r.reshape(g.num_blocks, g.block_len)[out.blocks].tobytes()
                            for r in regions
                        )

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
            engine.fabric.close()


def _run(mode: Mode, fabric: str) -> tuple[dict[str, str], dict[str, bytes]]:
    world = _World(mode, fabric)
    p, d = world.engines
    try:
        for key, p_blocks, d_blocks, what in _SCRIPT:
            pid, did = f"{key}-0000000a", f"{key}-0000000b"
            pb, db = np.array(p_blocks, dtype=np.int32), np.array(d_blocks, dtype=np.int32)
            write_request(p.kv, request_seed(key), pb, unit_tokens=4)
            p.submit(Admit(pid, pb))
            if what.startswith("abort P"):
                p.submit(Abort(pid))
            else:
                p.submit(PrefillFinished(pid, pb))
            d.submit(Admit(did, db, world.p_name, 1, pid if mode == "pull" else ""))
            if what.startswith("abort D"):
                d.submit(Abort(did))
                p.submit(Abort(pid))  # the serving engine's part: P's request goes too
            world.settle({pid, did})
        return {k.rsplit("-", 1)[0] + k[-1]: v for k, v in world.finals.items()}, world.received
    finally:
        world.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_sim_and_nixl_agree(mode: Mode) -> None:
    sim_finals, sim_bytes = _run(mode, "sim")
    real_finals, real_bytes = _run(mode, "nixl")
    assert sim_finals == real_finals
    assert sim_bytes == real_bytes
    assert sim_finals["plaina"] == sim_finals["plainb"] == "done"  # the script is not vacuous
    assert sim_finals["p-aborta"] == "aborted" and sim_finals["d-abortb"] == "aborted"
