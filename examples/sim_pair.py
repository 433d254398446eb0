"""Two engines, P and D, in one process on the simulated fabric: one request's KV moved in push
mode (P WRITEs into D's blocks), then every byte compared. The library used directly: the core
(`Producer`, `Consumer`) takes events and the engine runs its commands on a fabric.

Run: python examples/sim_pair.py
"""

from __future__ import annotations

import numpy as np

from kvfsm.core import Admit, Consumer, Finished, Identity, PrefillFinished, Producer
from kvfsm.fabric import SimNetwork
from kvfsm.layout import KvGeometry
from kvfsm.runtime import Engine, KvCache
from kvfsm.sidechannel import LocalDirectory

GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=4, head_dim=8, dtype_bytes=2, block_size=16, num_blocks=32
)


def main() -> int:
    network = SimNetwork(seed=0)  # the simulated fabric: agents on a virtual clock

    def clock() -> float:
        return network.now

    directory = LocalDirectory(clock)  # how engines find each other (ZmqDirectory for real)
    engines = {}
    for core in (Producer(Identity("prefill"), "push"), Consumer(Identity("decode"), "push")):
        agent = core.identity.agent
        kv = KvCache.allocate(GEOMETRY)
        engine = Engine(core, network.agent(agent), kv, directory.view(clock, agent), clock)
        directory.publish(agent, engine.info, clock)
        engines[core.identity.engine_id] = engine
    p, d = engines["prefill"], engines["decode"]

    # P's prefill writes KV into blocks 3 and 4 (here: random bytes); D will receive them in
    # its blocks 10 and 11. Request ids end in a random suffix, as vLLM's do.
    p_blocks, d_blocks = np.array([3, 4], np.int32), np.array([10, 11], np.int32)
    region = p.kv.regions()[0].reshape(GEOMETRY.num_blocks, GEOMETRY.block_len)
    region[p_blocks] = np.random.default_rng(0).integers(0, 256, region[p_blocks].shape)
    p.submit(Admit("req-p-0000000a", p_blocks))
    d.submit(Admit("req-d-0000000b", d_blocks, "prefill", 1, "req-p-0000000a"))
    p.submit(PrefillFinished("req-p-0000000a", p_blocks))

    ended: dict[str, str] = {}
    while len(ended) < 2 and network.now < 60:
        network.advance(1e-3)
        for engine in (p, d):
            engine.poll()
            for output in engine.take_outputs():
                if isinstance(output, Finished):
                    ended[engine.agent] = output.state
    moved = all(
        np.array_equal(
            src.reshape(GEOMETRY.num_blocks, -1)[p_blocks],
            dst.reshape(GEOMETRY.num_blocks, -1)[d_blocks],
        )
        for src, dst in zip(p.kv.regions(), d.kv.regions(), strict=True)
    )
    print(f"P: {ended.get(p.agent)}, D: {ended.get(d.agent)}, bytes equal: {moved}")
    return 0 if ended == {p.agent: "done", d.agent: "done"} and moved else 1


if __name__ == "__main__":
    raise SystemExit(main())
