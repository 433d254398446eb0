"""A P/D deployment in one process for tests, the demo and benchmarks: engines on the simulated
fabric (a `SimNetwork`) or on real NIXL agents, block allocators standing in for the serving
engines' schedulers, and the six safety properties checked as the engines report what they do."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, cast

import msgspec
import numpy as np

from kvfsm.core import (
    Abort,
    Admit,
    Consumer,
    CoreConfig,
    Finished,
    Identity,
    InternalError,
    Mode,
    NotificationReceived,
    PrefillFinished,
    Producer,
    ReleaseBlocks,
    ReportFailed,
    ReportReceived,
    Shutdown,
    Side,
    agent_name,
)
from kvfsm.fabric import (
    UCX_ERROR_HANDLING_DEFAULT,
    Fabric,
    NixlFabric,
    SimFaults,
    SimNetwork,
    UcxErrorHandling,
)
from kvfsm.layout import KvGeometry
from kvfsm.runtime import CallerOutput, Directory, Engine, KvCache
from kvfsm.sidechannel import DirectoryView, LocalDirectory
from kvfsm.sim._invariants import Conformance, Ledger
from kvfsm.sim._losses import LossyInbox
from kvfsm.sim._pattern import request_seed, write_request
from kvfsm.sim._presets import FAST_CONFIG, SMALL_GEOMETRY
from kvfsm.wire import SharedSecret

__all__ = ["Cluster", "PairedRequest"]

_REAL_STEP_S = 1e-3  # the longest a step waits on real NIXL: messages travel in microseconds


def _side_geometries(
    geometry: KvGeometry, num_blocks: int, d_block_size: int | None, p_tp: int, d_tp: int
) -> dict[str, KvGeometry]:
    """P's and D's geometries: `geometry` with `num_blocks`, D's blocks `d_block_size` tokens
    (default: P's; a multiple of P's)."""
    base = msgspec.structs.replace(geometry, num_blocks=num_blocks)
    d_bs = d_block_size or geometry.block_size
    if d_bs % geometry.block_size:
        raise ValueError(f"D's block size {d_bs} must be a multiple of P's {geometry.block_size}")
    return {
        "P": msgspec.structs.replace(base, tp_size=p_tp),
        "D": msgspec.structs.replace(base, tp_size=d_tp, block_size=d_bs),
    }


@dataclass
class PairedRequest:
    """One request as both sides see it."""

    key: str
    p_id: str
    d_id: str
    p_blocks: np.ndarray
    d_blocks: np.ndarray
    finished_prefill: bool = False
    final: dict[str, str] = field(default_factory=dict)  # agent -> terminal state


class Cluster:
    """P and D engines (any TP sizes) in this process, on the simulated fabric (the default) or
    real NIXL agents, with the safety properties checked."""

    def __init__(
        self,
        mode: Mode,
        *,
        seed: int = 0,
        faults: SimFaults | None = None,
        config: CoreConfig = FAST_CONFIG,
        num_blocks: int = 64,
        geometry: KvGeometry = SMALL_GEOMETRY,
        d_block_size: int | None = None,
        p_tp: int = 1,
        d_tp: int = 1,
        conformance: bool = True,
        handshake_latency: float = 1e-3,
        trace: bool = True,
        fabric: Literal["sim", "nixl"] = "sim",
        ucx_error_handling: UcxErrorHandling = UCX_ERROR_HANDLING_DEFAULT,
        clock_skew: Mapping[str, float] | None = None,
        secret: SharedSecret | None = None,
    ) -> None:
        """P's ranks use `geometry` (with `num_blocks`), D's the same with `d_block_size` tokens
        per block (default: P's; it must be a multiple of P's).

        With ``fabric="nixl"`` every rank gets a real NIXL agent in this process and time is
        the monotonic clock: the operations both fabrics support (admit, prefill, abort, time)
        run unchanged, the safety ledger checks them alike, and `step` only polls (time passes
        on its own); faults, kills and revivals exist on the simulated fabric only. `close()`
        releases the agents; `ucx_error_handling` is their UCX error handling mode.
        `clock_skew` maps a side ("P", "D") to seconds added to its engines' clocks: hosts
        whose monotonic clocks started at different times. `secret`: the engines' shared
        secret (every notification sealed and checked); engines take notifications only from
        peers that handshaked with them or they with."""
        self.mode: Mode = mode
        self.config = config
        self.network = SimNetwork(seed, faults)
        self.real = fabric == "nixl"
        self.clock_skew = {"P": 0.0, "D": 0.0, **(clock_skew or {})}
        self.ucx_error_handling: UcxErrorHandling = ucx_error_handling
        self.secret = secret
        self._t0 = time.monotonic()
        self.directory = LocalDirectory(lambda: self.now, 0.0 if self.real else handshake_latency)
        self.geometry = _side_geometries(geometry, num_blocks, d_block_size, p_tp, d_tp)
        self.unit_tokens = min(g.block_size for g in self.geometry.values())
        self.rng = random.Random(seed)
        self.p_tp, self.d_tp = p_tp, d_tp
        self.conformance = Conformance() if conformance else None
        self.trace = trace
        self.engines: dict[str, Engine] = {}
        self._views: dict[str, DirectoryView] = {}
        self._starts: Counter[str] = Counter()  # incarnations: the same in every replay
        self.dead: set[str] = set()
        self.requests: dict[str, PairedRequest] = {}
        self.ledger = Ledger(self)
        self.on_finished: Callable[[str, Finished], None] | None = None
        self.output_listeners: list[Callable[[str, CallerOutput], None]] = []
        """Called with (agent, output) for every caller output, before the ledger checks it."""
        self._free = {"P": list(range(num_blocks)), "D": list(range(num_blocks))}
        for rank in range(p_tp):
            self._start("P", rank)
        for rank in range(d_tp):
            self._start("D", rank)

    # --- topology ----------------------------------------------------------------------------

    def agents(self, side: str) -> list[str]:
        """The agent names of one side's ranks."""
        tp = self.p_tp if side == "P" else self.d_tp
        return [agent_name(side, r) for r in range(tp)]

    def live(self, side: str) -> Iterator[Engine]:
        """The live engines of one side."""
        return (self.engines[a] for a in self.agents(side) if a not in self.dead)

    def _start(self, side: str, rank: int) -> Engine:
        agent = agent_name(side, rank)
        tp = self.p_tp if side == "P" else self.d_tp
        config = msgspec.structs.replace(self.config, trace=self.trace)
        core: Side = (Producer if side == "P" else Consumer)(
            Identity(side, rank, tp), self.mode, config
        )
        if self.conformance is not None:
            core.set_recorder(self.conformance.record)
        fabric = self._new_fabric(agent)
        kv = KvCache.allocate(self.geometry[side].for_rank(rank))
        skew = self.clock_skew[side]
        clock = (lambda: self.now + skew) if skew else (lambda: self.now)
        self._starts[agent] += 1
        engine = Engine(
            core,
            fabric,
            kv,
            self._new_directory(agent, clock),
            clock,
            secret=self.secret,
            guests=self.directory.guests,
            incarnation=self._starts[agent],
        )
        self.engines[agent] = engine
        self._publish(engine, clock)
        self.dead.discard(agent)
        return engine

    def _new_fabric(self, agent: str) -> Fabric:
        if self.real:
            return NixlFabric(agent, ucx_error_handling=self.ucx_error_handling)
        if agent in self.engines:
            return self.network.revive(agent)
        return self.network.agent(agent)

    def _new_directory(self, agent: str, clock: Callable[[], float]) -> Directory:
        self._views[agent] = view = self.directory.view(clock, agent)
        return view

    def _publish(self, engine: Engine, clock: Callable[[], float]) -> None:
        self.directory.publish(engine.agent, engine.info, clock, engine.transfer_status)

    def kill(self, agent: str, reset: bool) -> None:
        """The process of `agent` dies: with `reset`, peers see the connection reset; else silence."""
        if self.real:
            raise NotImplementedError("the real fabric cannot be told to kill an agent")
        if agent in self.dead:
            return
        self.network.kill(agent, reset)
        self.directory.withdraw(agent)
        self.dead.add(agent)
        self.ledger.forget_engine(agent)

    def lose_notification(self, agent: str, kind: str) -> None:
        """The next notification of `kind` (a wire tag, e.g. "done") reaching `agent` is lost;
        on either fabric (taken off where it arrives)."""
        self._inbox(agent).lose_next(kind)

    def notification_outage(self, agent: str, seconds: float) -> None:
        """Every notification reaching `agent` is lost for `seconds`; on either fabric."""
        self._inbox(agent).outage(seconds)

    def cut_side_channel(self, agent: str, cut: bool = True) -> None:
        """Cut (or restore) the side channel to `agent`: handshakes with it fail, questions to
        it go unanswered; its NIXL traffic goes on."""
        self.directory.cut(agent, cut)

    def _inbox(self, agent: str) -> LossyInbox:
        engine = self.engines[agent]
        if not isinstance(engine.fabric, LossyInbox):
            clock = engine.clock
            engine.fabric = cast(Fabric, LossyInbox(engine.fabric, clock))
        return cast(LossyInbox, engine.fabric)

    def revive(self, agent: str) -> None:
        """A new process takes the dead agent's place (new memory, new core)."""
        if agent in self.dead:
            side, rank = agent.split("#")
            self._start(side, int(rank))

    # --- requests ------------------------------------------------------------------------------

    def can_admit(self, n_blocks: int) -> bool:
        """Whether both allocators have `n_blocks` free."""
        return min(len(self._free["P"]), len(self._free["D"])) >= n_blocks

    def admit(
        self,
        key: str,
        n_blocks: int,
        d_cached: int = 0,
        d_first: bool = False,
        same_id: bool = False,
    ) -> PairedRequest:
        """Admit a request of `n_blocks` P blocks on every rank of both sides; D already holds
        the first `d_cached` of its blocks (a prefix-cache hit)."""
        suffix = f"{self.rng.getrandbits(32):08x}"
        p_id = f"{key}-{suffix}"
        d_id = p_id if same_id else f"{key}-{self.rng.getrandbits(32):08x}"
        d_total = -(-n_blocks // self.block_ratio)
        pr = PairedRequest(
            key,
            p_id,
            d_id,
            self._alloc("P", n_blocks),
            self._alloc("D", d_total - min(d_cached, d_total)),
        )
        self.requests[key] = pr
        self.ledger.admitted(pr)
        order = (self._admit_d, self._admit_p) if d_first else (self._admit_p, self._admit_d)
        for admit in order:
            admit(pr)
        return pr

    @property
    def block_ratio(self) -> int:
        """Tokens in a D block per token in a P block."""
        return self.geometry["D"].block_size // self.geometry["P"].block_size

    def _admit_p(self, pr: PairedRequest) -> None:
        for engine in self.live("P"):
            engine.submit(Admit(pr.p_id, pr.p_blocks))
        self.collect()

    def _admit_d(self, pr: PairedRequest) -> None:
        peer_id = pr.p_id if self.mode == "pull" or pr.p_id == pr.d_id else ""
        for engine in self.live("D"):
            engine.submit(Admit(pr.d_id, pr.d_blocks, "P", self.p_tp, peer_id))
        self.collect()

    def finish_prefill(self, key: str, without_blocks: bool = False) -> None:
        """P's prefill of `key` is done: its blocks get the request's recognisable bytes. With
        `without_blocks`, P ends up with no KV for it (D then must not report success)."""
        pr = self.requests[key]
        if pr.finished_prefill:
            return
        pr.finished_prefill = True
        blocks = pr.p_blocks[:0] if without_blocks else pr.p_blocks
        for engine in self.live("P"):
            if pr.p_id in engine.side.requests:
                self._fill(engine, pr)
            engine.submit(PrefillFinished(pr.p_id, blocks))
        self.collect()

    def serve(self, key: str, n_blocks: int) -> dict[str, str]:
        """Admit a request, finish its prefill, settle; its final state on every rank."""
        self.admit(key, n_blocks)
        self.finish_prefill(key)
        self.settle()
        return self.requests[key].final

    def abort(self, key: str, side: str) -> None:
        """The serving engine of `side` aborts `key`."""
        pr = self.requests[key]
        for engine in self.live(side):
            engine.submit(Abort(pr.p_id if side == "P" else pr.d_id))
        self.collect()

    def shutdown(self) -> None:
        """Shut every live engine down, let them drain, and close them."""
        for engine in self.live_engines():
            engine.submit(Shutdown())
        self.collect()
        self.settle()
        for engine in self.live_engines():
            engine.close()

    def inject_garbage(self, agent: str, payload: bytes) -> None:
        """A malformed notification reaches `agent`."""
        if agent not in self.dead:
            self.engines[agent].submit(NotificationReceived("stranger#0", payload))
            self.collect()

    def _fill(self, engine: Engine, pr: PairedRequest) -> None:
        write_request(engine.kv, request_seed(pr.p_id), pr.p_blocks, unit_tokens=self.unit_tokens)

    # --- time and outputs ------------------------------------------------------------------------

    @property
    def now(self) -> float:
        """Seconds since the cluster started: simulated, or real on the real fabric."""
        return time.monotonic() - self._t0 if self.real else self.network.now

    def close(self) -> None:
        """Shut the engines down and release their agents (needed on the real fabric)."""
        for engine in self.live_engines():
            engine.close()
            engine.fabric.close()

    def step(self, dt: float) -> None:
        """Advance the clock by `dt`, then let every live engine poll. On real NIXL time passes
        on its own: a step waits `dt`, at most a millisecond, so that a run waiting for real
        deadlines polls as an engine loop does instead of spinning a core."""
        if self.real:
            time.sleep(min(dt, _REAL_STEP_S))
        else:
            self.network.advance(dt)
        for agent, engine in self.engines.items():
            if agent not in self.dead:
                engine.poll()
        self.collect()

    def collect(self) -> None:
        """Take every engine's caller outputs and check them against the safety properties."""
        for agent, engine in self.engines.items():
            if agent not in self.dead:
                for output in engine.take_outputs():
                    for listener in self.output_listeners:
                        listener(agent, output)
                    self._on_output(agent, output)
        self.ledger.check_posts()

    def _on_output(self, agent: str, out: CallerOutput) -> None:
        if isinstance(out, InternalError):
            self.ledger.internal_errors.append(f"internal error on {agent}: {out.detail}")
            return
        pr = self.ledger.request_of(agent, out.request_id)
        if pr is None:
            return
        if isinstance(out, ReleaseBlocks | ReportReceived):
            self.ledger.released(agent, pr, out)
        elif isinstance(out, ReportFailed):
            self.ledger.failed(agent, pr)
        elif isinstance(out, Finished):
            pr.final[agent] = out.state
            self.ledger.finished(agent, pr, out.state)
            if self.on_finished is not None:
                self.on_finished(agent, out)

    def settle(self, horizon: float | None = None) -> None:
        """Run the clock until every request on live engines ended, up to `horizon` seconds."""
        c = self.config
        bounds = c.lease_s + c.watchdog_s + c.producer_stall_s + c.fence_s
        limit = horizon or 4 * (bounds + self.network.faults.late_delivery)
        end = self.now + limit
        while self.now < end and not self.quiet():
            self.step(min(c.heartbeat_s, c.stall_s) / 2)

    def next_due(self) -> float | None:
        """When something next happens on its own, on the cluster's clock: a network event, a
        live engine's wakeup (its own clock, skew taken off) or a handshake finishing."""
        times = [self.network.next_event_time()]
        for agent, engine in self.engines.items():
            if agent not in self.dead:
                wakeup = engine.next_wakeup()
                times.append(None if wakeup is None else wakeup - self.clock_skew[agent[0]])
                times.append(self._views[agent].next_due())
        return min((t for t in times if t is not None), default=None)

    def quiet(self) -> bool:
        """No request left on any live engine, nothing in flight and no block held."""
        return all(
            not e.side.requests and not e.inflight and not len(e.side.quarantine)
            for e in self.live_engines()
        )

    def live_engines(self) -> Iterator[Engine]:
        """Every live engine."""
        return (e for a, e in self.engines.items() if a not in self.dead)

    # --- allocators ------------------------------------------------------------------------------

    def _alloc(self, side: str, n: int) -> np.ndarray:
        free = self._free[side]
        if n > len(free):
            raise RuntimeError(f"{side} has {len(free)} free blocks, {n} asked")
        picked = [free.pop(self.rng.randrange(len(free))) for _ in range(n)]
        return np.array(picked, dtype=np.int32)

    def free(self, side: str, blocks: np.ndarray) -> None:
        """Blocks go back to a side's allocator (called by the ledger once every rank released)."""
        self._free[side].extend(int(b) for b in blocks)
