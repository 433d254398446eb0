"""`kvfsm demo --fabric sim`: requests through P and D engines on the simulated fabric in this
process, with partial and full prefix hits on D and the safety ledger checking every property;
like the real fabric's demo, the engines share a fresh secret (every notification sealed)."""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable

import msgspec

from kvfsm.cli.demo._report import DemoReport, time_in_state, worst_state
from kvfsm.core import CoreConfig, Mode, Verify
from kvfsm.sim import SMALL_GEOMETRY, Cluster
from kvfsm.wire import SharedSecret

__all__ = ["run_sim_demo"]


def run_sim_demo(
    mode: Mode,
    requests: int,
    *,
    seed: int = 0,
    p_tp: int = 1,
    d_tp: int = 1,
    p_block_size: int = 4,
    d_block_size: int | None = None,
    max_blocks: int = 32,
    progress: Callable[[int], None] | None = None,
    verify: Verify = "off",
) -> DemoReport:
    """Drive `requests` requests of random length through P and D on the simulated fabric (with
    `SMALL_GEOMETRY`'s model; D's blocks hold `d_block_size` tokens, a multiple of P's);
    `verify` as `CoreConfig.verify`."""
    cpu0 = time.process_time()
    cluster = Cluster(
        mode,
        seed=seed,
        config=CoreConfig(verify=verify),
        num_blocks=max_blocks * 16,
        geometry=msgspec.structs.replace(SMALL_GEOMETRY, block_size=p_block_size),
        d_block_size=d_block_size,
        p_tp=p_tp,
        d_tp=d_tp,
        conformance=False,
        secret=SharedSecret(os.urandom(32)),
    )
    rng = random.Random(seed)
    admitted = ended = 0
    histories: list[tuple[str, tuple[tuple[str, str, float], ...]]] = []
    cluster.on_finished = lambda agent, out: histories.append((agent[0], out.history))
    agents = len(cluster.agents("P")) + len(cluster.agents("D"))
    while ended < requests:
        while admitted < requests:
            n = rng.randint(1, max_blocks)
            if not cluster.can_admit(n):
                break
            admitted += 1
            key = f"req{admitted}"
            cluster.admit(key, n, d_cached=rng.choice([0, 0, 0, rng.randint(0, n)]))
            cluster.finish_prefill(key)
        cluster.step(1e-3)
        now_ended = sum(len(pr.final) == agents for pr in cluster.requests.values())
        if progress is not None and now_ended > ended:
            progress(now_ended - ended)
        ended = now_ended
        if cluster.network.now > 3600:  # nothing in the core can wait this long
            break
    cluster.settle()
    return _report(cluster, requests, histories, time.process_time() - cpu0)


def _report(
    cluster: Cluster,
    requests: int,
    histories: list[tuple[str, tuple[tuple[str, str, float], ...]]],
    cpu_s: float,
) -> DemoReport:
    d_agents = set(cluster.agents("D"))
    outcome: Counter[str] = Counter()
    for pr in cluster.requests.values():
        states = {s for a, s in pr.final.items() if a in d_agents}
        outcome[worst_state(states)] += 1
    violations = cluster.ledger.quiescence()
    counters: Counter[str] = Counter()
    for engine in cluster.engines.values():  # the engine's and its core's, as on NIXL
        counters.update(engine.counters + engine.side.counters)
    # The ledger compared every byte of every request a D rank reported received.
    expected_some = any(len(pr.d_blocks) for pr in cluster.requests.values())
    return DemoReport(
        mode=cluster.mode,
        fabric="sim",
        requests=requests,
        done=outcome["done"],
        failed=outcome["failed"],
        expired=outcome["expired"],
        aborted=outcome["aborted"],
        bytes=counters["bytes"],
        verified=not violations and (cluster.ledger.verified_bytes > 0 or not expected_some),
        violations=violations,
        p_tp=cluster.p_tp,
        d_tp=cluster.d_tp,
        finals=dict(cluster.ledger.finals),
        time_in_state_ms=time_in_state(histories),
        counters=dict(counters),
        simulated_s=cluster.network.now,
        cpu_s=cpu_s,
        p_block_size=cluster.geometry["P"].block_size,
        d_block_size=cluster.geometry["D"].block_size,
    )
