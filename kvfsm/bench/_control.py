"""CPU per request lifecycle, P and D together, with N requests in flight (`kvfsm bench` and
benchmarks/control_plane.py).

Two measurements, each in waves of N requests admitted at once and run to `done`:

* core: the sans-I/O `Producer` and `Consumer` wired back to back (commands answered directly), so
  the figure is the lifecycle machinery alone: dispatch, guards, deadlines, matching, messages;
* engine: the same through two `Engine`s on `SimFabric` (descriptors, notifications, polling,
  64-byte blocks so that copying is negligible).

Figures are CPU microseconds per lifecycle, best of `repeat`. The work per lifecycle is the same
at every N (history tracing on, as in production); the harness keeps its own cost flat too (its
queue holds no tuple per event, which the cycle collector would traverse at every collection).
`memory_per_request` counts what kvfsm holds per request mid-transfer.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kvfsm.core import (
    Admit,
    Consumer,
    CoreConfig,
    Finished,
    HandshakeDone,
    Identity,
    Mode,
    NotificationReceived,
    PostTransfer,
    PrefillFinished,
    Producer,
    SendNotification,
    StartHandshake,
    TransferResult,
)
from kvfsm.fabric import SimNetwork
from kvfsm.layout import KvGeometry
from kvfsm.runtime import Conformance, Engine, KvCache
from kvfsm.sidechannel import LocalDirectory

__all__ = ["control_bench", "core_wave", "engine_wave", "make_engines", "memory_per_request"]

_CONFIG = CoreConfig(trace=True)  # history always on, as in production


def _blocks(i: int) -> np.ndarray:
    return np.array([i], dtype=np.int32)


def core_wave(mode: Mode, n: int, p: Producer, d: Consumer, wave: int) -> None:
    """Run n lifecycles through two cores, answering every command in place.

    The queue holds a side and its event as two entries, not a tuple: tuples holding a side are
    tracked by the cycle collector, whose passes over them are the harness's cost, not the core's.
    """
    queue: deque[Any] = deque()
    put = queue.append
    agent = {p: p.identity.agent, d: d.identity.agent}
    for i in range(n):
        pid, did = f"w{wave}r{i}-0000000a", f"w{wave}r{i}-0000000b"
        put(p), put(Admit(pid, _blocks(i)))
        put(p), put(PrefillFinished(pid, _blocks(i)))
        put(d), put(Admit(did, _blocks(i), "P", 1, pid if mode == "pull" else ""))
    finished = 0
    take = queue.popleft
    while queue:
        side = take()
        for cmd in side.handle(take(), 0.0):
            kind = type(cmd)
            if kind is SendNotification:
                put(d if side is p else p), put(NotificationReceived(agent[side], cmd.payload))
            elif kind is PostTransfer:
                put(side), put(TransferResult(cmd.request_id, cmd.transfer_id, True))
                put(d if side is p else p)
                put(NotificationReceived(agent[side], cmd.notification))
            elif kind is StartHandshake:
                put(side), put(HandshakeDone(cmd.peer))
            elif kind is Finished:
                finished += 1
    assert finished == 2 * n, f"only {finished} of {2 * n} sides finished"


def engine_wave(mode: Mode, n: int, p: Engine, d: Engine, net: SimNetwork, wave: int) -> None:
    """Run n lifecycles through two engines on the simulated fabric."""
    for i in range(n):
        pid, did = f"w{wave}r{i}-0000000a", f"w{wave}r{i}-0000000b"
        p.submit(Admit(pid, _blocks(i)))
        p.submit(PrefillFinished(pid, _blocks(i)))
        d.submit(Admit(did, _blocks(i), "P", 1, pid if mode == "pull" else ""))
    finished = 0
    while finished < 2 * n:
        net.advance(1e-3)
        p.poll()
        d.poll()
        finished += sum(isinstance(o, Finished) for o in p.take_outputs() + d.take_outputs())


def measure(run: Callable[[int], None], n: int, total: int, repeat: int) -> float:
    """Best CPU microseconds per lifecycle over `repeat` runs of `total` lifecycles in waves of n."""
    best = float("inf")
    waves = max(1, total // n)
    for attempt in range(repeat):
        gc.collect()
        start = time.process_time()
        for wave in range(waves):
            run(attempt * waves + wave)  # request ids never repeat
        spent = time.process_time() - start
        best = min(best, spent / (max(1, total // n) * n) * 1e6)
    return best


def make_engines(mode: Mode, n: int) -> tuple[Engine, Engine, SimNetwork]:
    """A P and a D `Engine` on one simulated network, with caches of 64-byte blocks for n
    requests in flight."""
    net = SimNetwork(0)
    directory = LocalDirectory(lambda: net.now)
    # One region of 64-byte blocks (1 layer, 1 head of 32 bytes for K and V, 1 token).
    geometry = KvGeometry(
        num_layers=1, num_kv_heads=1, head_dim=32, dtype_bytes=1, block_size=1, num_blocks=max(n, 1)
    )
    engines = []
    for side in (Producer(Identity("P"), mode, _CONFIG), Consumer(Identity("D"), mode, _CONFIG)):
        kv = KvCache.allocate(geometry)
        engine = Engine(side, net.agent(side.identity.agent), kv, directory.view(), lambda: net.now)
        directory.publish(engine.agent, engine.info)
        engines.append(engine)
    return engines[0], engines[1], net


def control_bench(
    mode: Mode, n: int, total: int, repeat: int, *, conformance: bool = False
) -> dict[str, float]:
    """Core and engine figures for one mode and number in flight; with `conformance`, the core
    again with every step replayed through `transitions` (the run-time check's cost)."""
    p, d = Producer(Identity("P"), mode, _CONFIG), Consumer(Identity("D"), mode, _CONFIG)
    core_us = measure(lambda w: core_wave(mode, n, p, d, w), n, total, repeat)
    ep, ed, net = make_engines(mode, n)
    engine_us = measure(lambda w: engine_wave(mode, n, ep, ed, net, w), n, total, repeat)
    out = {"core_us": round(core_us, 1), "engine_us": round(engine_us, 1)}
    if conformance:
        p, d = Producer(Identity("P"), mode, _CONFIG), Consumer(Identity("D"), mode, _CONFIG)
        for side in (p, d):
            side.set_recorder(Conformance().record)
        checked = measure(lambda w: core_wave(mode, n, p, d, w), n, total, repeat)
        out["core_conformance_us"] = round(checked, 1)
    return out


def memory_per_request(mode: Mode, n: int) -> float:
    """Bytes the two cores hold per request while n requests wait mid-transfer: matched, the
    transfer posted, its result and completion not delivered yet (tracemalloc, counting what
    kvfsm allocated: the held results' payloads count, this harness's own objects do not)."""
    p, d = Producer(Identity("P"), mode, _CONFIG), Consumer(Identity("D"), mode, _CONFIG)
    core_wave(mode, 1, p, d, -1)  # peers connected before the measurement
    held: list[object] = []
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(n):
        pid, did = f"m{i}-0000000a", f"m{i}-0000000b"
        queue: deque[Any] = deque()
        queue.extend((p, Admit(pid, _blocks(i)), p, PrefillFinished(pid, _blocks(i))))
        queue.extend((d, Admit(did, _blocks(i), "P", 1, pid if mode == "pull" else "")))
        while queue:
            side = queue.popleft()
            for cmd in side.handle(queue.popleft(), 0.0):
                if isinstance(cmd, SendNotification):
                    message = NotificationReceived(side.identity.agent, cmd.payload)
                    queue.extend((d if side is p else p, message))
                elif isinstance(cmd, PostTransfer):
                    held.append(cmd)  # the runtime keeps it until the transfer ends
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    assert len(p.requests) == len(d.requests) == len(held) == n
    kvfsm = [tracemalloc.Filter(True, "*/kvfsm/*"), tracemalloc.Filter(False, __file__)]
    grown = after.filter_traces(kvfsm).compare_to(before.filter_traces(kvfsm), "filename")
    return sum(stat.size_diff for stat in grown) / n
