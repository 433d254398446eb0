"""P and D engines in two processes over real NIXL (UCX on this host), handshaking over ZMQ and
authenticated with a shared secret: one request's KV moved in pull mode (D READs P's blocks),
then every byte compared on D.

Run: python examples/nixl_pair.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from multiprocessing.connection import Connection

import numpy as np

from kvfsm.core import Admit, Consumer, Finished, Identity, PrefillFinished, Producer
from kvfsm.harness import close_rank, open_rank
from kvfsm.layout import KvGeometry
from kvfsm.runtime import CallerOutput, EngineLoop, KvCache
from kvfsm.sidechannel import compat_hash
from kvfsm.wire import WIRE_VERSION

GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=4, head_dim=8, dtype_bytes=2, block_size=16, num_blocks=32
)
P_BLOCKS, D_BLOCKS = np.array([3, 4], np.int32), np.array([10, 11], np.int32)


def _kv_of_the_prefill() -> np.ndarray:
    """What P's prefill wrote into its two blocks, per region (both sides can compute it)."""
    size = (GEOMETRY.num_regions, len(P_BLOCKS), GEOMETRY.block_len)
    return np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)


def _rank(side: str, secret: bytes, conn: Connection) -> None:
    """One engine rank in its own process: open it, serve one request, report its end."""
    core = Producer(Identity("P"), "pull") if side == "P" else Consumer(Identity("D"), "pull")
    kv = KvCache.allocate(GEOMETRY)
    chash = compat_hash(
        wire_version=WIRE_VERSION, mode="pull", model="example", dtype="f16", geometry=GEOMETRY
    )
    rank = open_rank(core, kv, compat_hash=chash, secret=secret)
    ended: queue.Queue[str] = queue.Queue()

    def on_output(out: CallerOutput) -> None:
        if isinstance(out, Finished):
            ended.put(out.state)

    loop = EngineLoop(rank.engine, on_output)
    rank.directory.on_result = loop.wake
    loop.start()
    try:
        conn.send(rank.listener.port)  # where the other side's handshakes reach this one
        rank.addresses.update(conn.recv())
        if side == "P":
            for region, written in zip(kv.regions(), _kv_of_the_prefill(), strict=True):
                region.reshape(GEOMETRY.num_blocks, -1)[P_BLOCKS] = written
            loop.submit(Admit("req-p-0000000a", P_BLOCKS))
            loop.submit(PrefillFinished("req-p-0000000a", P_BLOCKS))
        else:
            loop.submit(Admit("req-d-0000000b", D_BLOCKS, "P", 1, "req-p-0000000a"))
        state = ended.get(timeout=60)
        equal = side == "P" or all(
            np.array_equal(region.reshape(GEOMETRY.num_blocks, -1)[D_BLOCKS], written)
            for region, written in zip(kv.regions(), _kv_of_the_prefill(), strict=True)
        )
        conn.send((state, equal))
    finally:
        close_rank(rank, loop)


def main() -> int:
    secret = os.urandom(32)  # the deployment's shared secret, the same on every engine
    context = mp.get_context("spawn")
    pipes: dict[str, Connection] = {}
    processes: list[mp.context.SpawnProcess] = []
    for side in ("P", "D"):
        mine, theirs = context.Pipe()
        process = context.Process(target=_rank, args=(side, secret, theirs))
        process.start()
        pipes[side], processes = mine, [*processes, process]
    ports = {side: pipe.recv() for side, pipe in pipes.items()}
    for pipe in pipes.values():  # every engine's agent name -> its listener
        pipe.send({f"{side}#0": ("127.0.0.1", port) for side, port in ports.items()})
    (p_state, _), (d_state, equal) = pipes["P"].recv(), pipes["D"].recv()
    for process in processes:
        process.join(30)
    print(f"P: {p_state}, D: {d_state}, bytes equal: {equal}")
    return 0 if (p_state, d_state, equal) == ("done", "done", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
