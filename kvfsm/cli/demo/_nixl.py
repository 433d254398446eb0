"""`kvfsm demo --fabric nixl`: P and D engines over real NIXL (UCX over DRAM), one process per TP
rank, handshakes over ZMQ on loopback, every byte D receives checked against what P's prefill
wrote.

The driver (this process) plays both serving engines' schedulers: it allocates each request's
blocks (the same ids on every rank of a side, as a TP group shares its block table), admits the
request on every rank, and frees the blocks once every rank of that side finished with them.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfsm.cli.demo._report import DemoReport, time_in_state, worst_state
from kvfsm.core import CoreConfig, Mode, Verify
from kvfsm.harness import RankProcesses, RankSpec, require_memory
from kvfsm.layout import DTYPES, MAX_BLOCKS, MIN_BLOCKS, model_geometry
from kvfsm.sidechannel import compat_hash
from kvfsm.wire import WIRE_VERSION

__all__ = ["Driver", "Tally", "run_nixl_demo"]


@dataclass
class _Request:
    key: str
    tokens: int
    blocks: dict[str, list[int]]  # side -> block ids
    ids: dict[str, str]  # side -> request id
    ended: dict[str, set[int]] = field(default_factory=lambda: {"P": set(), "D": set()})
    prefilled: float = 0.0
    received: float = 0.0


@dataclass
class Tally:
    """What the ranks reported over a run."""

    states: Counter[str] = field(default_factory=Counter)  # "D:done", ...
    d_outcomes: dict[str, set[str]] = field(default_factory=dict)  # key -> D ranks' states
    compared: int = 0
    wrong: int = 0
    received: int = 0
    handoff_ms: list[float] = field(default_factory=list)
    histories: list[tuple[str, Any]] = field(default_factory=list)
    descriptors: int = 0
    fabric_descriptors: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def take_finals(self, finals: dict[str, Any]) -> None:
        """Add the ranks' final counters and errors (`RankProcesses.stop`'s result)."""
        for agent, (_, counters, errors, _leftovers) in finals.items():
            self.counters.update(counters)
            self.errors += [f"{agent}: {e}" for e in errors]


def run_nixl_demo(
    mode: Mode,
    requests: int,
    *,
    seed: int = 0,
    p_tp: int = 1,
    d_tp: int = 1,
    model: str = "llama3-8b",
    p_block_size: int = 16,
    d_block_size: int = 16,
    memory_mib: float = 256,
    max_blocks: int = 8,
    progress: Callable[[int], None] | None = None,
    corrupt: int = 0,
    verify: Verify = "off",
) -> DemoReport:
    """Run `requests` requests of random length (up to `max_blocks` of the larger block size)
    through P (`p_tp` rank processes) and D (`d_tp`), each rank's KV cache holding `model`'s
    share within `memory_mib`. `corrupt`: flip one byte of P rank 0's KV in that many requests
    after the prefill (a negative control: the run must then fail its byte check); with
    `verify` on (`CoreConfig.verify`), after P's checksum, so that D's check fails those
    requests."""
    cpu0 = time.process_time()
    geometry = {
        "P": model_geometry(model, tp_size=p_tp, block_size=p_block_size, memory_mib=memory_mib),
        "D": model_geometry(model, tp_size=d_tp, block_size=d_block_size, memory_mib=memory_mib),
    }
    if d_block_size % p_block_size:
        raise ValueError(f"P's block size {p_block_size} must divide D's {d_block_size}")
    caches = [geometry["P"].for_rank(r).kv_bytes for r in range(p_tp)] + [
        geometry["D"].for_rank(r).kv_bytes for r in range(d_tp)
    ]
    block = max(g.block_len * g.num_regions for g in geometry.values())
    if abs(max(caches) - memory_mib * 2**20) >= block:  # the block limits sized it, not the flag
        print(
            f"kvfsm demo: a rank's cache holds {MIN_BLOCKS} to {MAX_BLOCKS:,} blocks: with"
            f" --memory-mib {memory_mib:g} the largest is {max(caches) / 2**20:,.1f} MiB",
            file=sys.stderr,
        )
    require_memory(
        sum(caches),
        f"{len(caches)} rank KV caches of {max(caches) / 2**30:,.2f} GiB at most",
        "a smaller --memory-mib",
    )
    hash_ = compat_hash(
        wire_version=WIRE_VERSION,
        mode=mode,
        model=model,
        dtype=DTYPES[model],
        geometry=geometry["P"],
    )
    # The demo runs as a deployment should: its ranks share a fresh secret that authenticates
    # every handshake and notification (docs/security.md).
    secret = os.urandom(32)
    ranks = RankProcesses()
    for side, tp, peer_tp in (("P", p_tp, d_tp), ("D", d_tp, p_tp)):
        for rank in range(tp):
            ranks.start(
                RankSpec(
                    side,
                    mode,
                    geometry[side].for_rank(rank),
                    peer_tp,
                    p_block_size,
                    hash_,
                    config=CoreConfig(verify=verify),
                    secret=secret,
                )
            )
    tally = Tally()
    try:
        ranks.connect(ranks.await_ready())
        t0 = time.monotonic()
        left = _drive(requests, seed, geometry, max_blocks, ranks, tally, progress, corrupt)
        wall = time.monotonic() - t0
    finally:
        tally.take_finals(ranks.stop())
    return _report(mode, requests, geometry, model, tally, left, wall, time.process_time() - cpu0)


class Driver:
    """Both serving engines' schedulers: allocate, admit on every rank, collect, free."""

    def __init__(
        self,
        seed: int,
        geometry: dict[str, Any],
        max_blocks: int,
        ranks: RankProcesses,
        tally: Tally,
        corrupt: int,
    ) -> None:
        self.rng = random.Random(seed)
        self.corrupt = corrupt  # the first this many requests get one wrong byte on P
        self.processes, self.tally = ranks, tally
        self.bs = {side: geometry[side].block_size for side in ("P", "D")}
        self.max_tokens = max_blocks * max(self.bs.values())
        self.ranks = {side: [a for a in ranks.pipes if a.startswith(side)] for side in ("P", "D")}
        self.free = {side: list(range(geometry[side].num_blocks)) for side in ("P", "D")}
        self.live: dict[str, _Request] = {}  # by key and by each side's request id
        self.admitted = self.done = 0

    def admit(self, requests: int) -> None:
        """Admit requests while both sides have free blocks for the next one."""
        while self.admitted < requests:
            tokens = self.rng.randint(1, self.max_tokens)
            need = {side: -(-tokens // bs) for side, bs in self.bs.items()}
            if any(len(self.free[side]) < need[side] for side in need):
                return
            key = f"req{self.admitted}"
            self.admitted += 1
            blocks = {s: [self._take_block(s) for _ in range(n)] for s, n in need.items()}
            ids = {s: f"{key}-{self.rng.getrandbits(32):08x}" for s in need}
            req = _Request(key, tokens, blocks, ids)
            self.live[key] = self.live[ids["P"]] = self.live[ids["D"]] = req
            arrays = {s: np.array(blocks[s], dtype=np.int32) for s in need}
            corrupt = self.admitted <= self.corrupt
            for agent in self.ranks["P"]:
                self.processes.send(agent, ("admit_p", key, ids["P"], arrays["P"], corrupt))
            for agent in self.ranks["D"]:
                msg = ("admit_d", key, ids["D"], arrays["D"], ids["P"], tokens)
                self.processes.send(agent, msg)

    def _take_block(self, side: str) -> int:
        free = self.free[side]
        return free.pop(self.rng.randrange(len(free)))  # fragmented, as after allocator churn

    def take(self, agent: str, msg: tuple[Any, ...]) -> bool:
        """Take one message from a rank; True if it ended a request on every rank."""
        req = _collect(msg, agent, self.live, self.tally)
        if req is None or any(len(req.ended[s]) < len(self.ranks[s]) for s in self.bs):
            return False
        for side in self.bs:
            self.free[side].extend(req.blocks[side])
            del self.live[req.ids[side]]
        del self.live[req.key]
        if self.tally.d_outcomes.get(req.key) == {"done"}:
            self.tally.handoff_ms.append((req.received - req.prefilled) * 1e3)
        self.done += 1
        return True


def _drive(
    requests: int,
    seed: int,
    geometry: dict[str, Any],
    max_blocks: int,
    ranks: RankProcesses,
    tally: Tally,
    progress: Callable[[int], None] | None,
    corrupt: int,
) -> int:
    """Admit and collect until every request ended on every rank; returns how many did not."""
    driver = Driver(seed, geometry, max_blocks, ranks, tally, corrupt)
    deadline = time.monotonic() + max(120.0, requests * 0.5)
    while driver.done < requests and time.monotonic() < deadline:
        driver.admit(requests)
        for agent, conn in ranks.readable(1.0):
            if driver.take(agent, conn.recv()) and progress is not None:
                progress(1)
        dead = ranks.dead()
        if dead:
            raise RuntimeError(f"rank processes died: {dead}; errors: {tally.errors[:5]}")
    return requests - driver.done


def _collect(
    msg: tuple[Any, ...], agent: str, live: dict[str, _Request], tally: Tally
) -> _Request | None:
    """Take one message from a rank; return its request if the message ended it on that rank."""
    kind = msg[0]
    if kind == "error":
        tally.errors.append(f"{agent}: {msg[1]}")
    elif kind == "prefilled":  # the request ends on P's ranks only after this message
        req = live[msg[1]]
        req.prefilled = max(req.prefilled, msg[2])
    elif kind == "received":
        tally.compared += msg[2]
        tally.wrong += msg[3]
        tally.received += 1
        req = live[msg[1]]
        req.received = max(req.received, msg[4])
    elif kind == "finished":
        _, rid, state, history, stats = msg
        req = live[rid]
        side, rank = agent.split("#")
        req.ended[side].add(int(rank))
        tally.states[f"{side}:{state}"] += 1
        tally.histories.append((side, history))
        tally.descriptors += stats["descriptors"]
        tally.fabric_descriptors += stats["fabric_descriptors"]
        if side == "D":
            tally.d_outcomes.setdefault(req.key, set()).add(state)
        return req
    return None


def _report(
    mode: Mode,
    requests: int,
    geometry: dict[str, Any],
    model: str,
    tally: Tally,
    left: int,
    wall: float,
    cpu_s: float,
) -> DemoReport:
    outcomes = Counter(worst_state(states) for states in tally.d_outcomes.values())
    violations = [f"{left} requests never ended"] if left else []
    violations += [f"{tally.wrong} bytes differ from what P wrote"] if tally.wrong else []
    violations += [f"rank error: {e}" for e in tally.errors[:20]]
    p50, p99 = (
        (float(np.percentile(tally.handoff_ms, q)) for q in (50, 99))
        if tally.handoff_ms
        else (0.0, 0.0)
    )
    return DemoReport(
        mode=mode,
        fabric="nixl",
        requests=requests,
        done=outcomes["done"],
        failed=outcomes["failed"],
        expired=outcomes["expired"],
        aborted=outcomes["aborted"],
        bytes=tally.compared,
        verified=not tally.wrong
        and tally.compared > 0
        and tally.received == outcomes["done"] * geometry["D"].tp_size,
        violations=violations,
        p_tp=geometry["P"].tp_size,
        d_tp=geometry["D"].tp_size,
        finals=dict(tally.states),
        time_in_state_ms=time_in_state(tally.histories),
        counters=dict(tally.counters),
        simulated_s=0.0,
        cpu_s=cpu_s,
        wall_s=round(wall, 3),
        gbps=round(tally.compared / wall / 1e9, 3) if wall else 0.0,
        handoff_ms_p50=round(p50, 3),
        handoff_ms_p99=round(p99, 3),
        model=model,
        p_block_size=geometry["P"].block_size,
        d_block_size=geometry["D"].block_size,
        descriptors=tally.descriptors,
        fabric_descriptors=tally.fabric_descriptors,
    )
