"""The six safety properties (docs/testing.md), checked on a `Cluster` as its engines report.

1 terminal, 2 no early free, 3 no late write, 4 no silent corruption, 5 no leak: `Ledger`.
6 conformance: `Conformance` replays every step the core took through the `transitions` machine.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvfsm.core import ReportReceived, Step
from kvfsm.fabric import FabricError
from kvfsm.lifecycle import MODEL_NAMES, load
from kvfsm.runtime import Conformance as RuntimeConformance
from kvfsm.sim._pattern import check_request, request_seed

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvfsm.core import ReleaseBlocks
    from kvfsm.runtime import Engine, InFlight, KvCache
    from kvfsm.sim._cluster import Cluster, PairedRequest

__all__ = ["COVERAGE", "Conformance", "Ledger", "LedgerBooks", "untaken_transitions"]

COVERAGE: Counter[tuple[str, str, str, str]] = Counter()
"""Every (lifecycle, source, event, dest) taken in this process, for the coverage report."""


def untaken_transitions() -> list[tuple[str, str, str, str]]:
    """The model transitions never taken in this process."""
    return sorted(
        (name, *edge)
        for name in MODEL_NAMES
        for edge in load(name).edges
        if (name, *edge) not in COVERAGE
    )


class Conformance(RuntimeConformance):
    """Property 6, as `kvfsm.runtime.Conformance` checks it in production, also counting each
    transition taken for the coverage report (`COVERAGE`). Keeps every violation."""

    def __init__(self) -> None:
        super().__init__(keep=None)  # a test reports them all

    def record(self, step: Step) -> None:
        """Check one step (installed as the core's recorder)."""
        COVERAGE[(step.lifecycle, step.source, step.event, step.dest)] += 1
        super().record(step)


class LedgerBooks(NamedTuple):
    """The ledger's books, read-only, keys (agent or request key, ...) as the ledger keeps them:
    releases counted per (agent, request), reported failures and receptions, blocks freed, and
    per request the agents that still owe a release."""

    released: tuple[tuple[tuple[str, str], int], ...]
    received: tuple[tuple[str, str], ...]
    failed: tuple[tuple[str, str], ...]
    owed: tuple[tuple[str, tuple[str, ...]], ...]
    freed: tuple[tuple[str, str], ...]


class Ledger:
    """Properties 1-5, from what the engines tell their caller."""

    def snapshot(self) -> LedgerBooks:
        """The books as they stand (see `LedgerBooks`), each part sorted."""
        return LedgerBooks(
            released=tuple(sorted(self._released.items())),
            received=tuple(sorted(self._received)),
            failed=tuple(sorted(self._failed)),
            owed=tuple(sorted((k, tuple(sorted(v))) for k, v in self._owed.items())),
            freed=tuple(sorted(self._freed)),
        )

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.violations: list[str] = []
        self.internal_errors: list[str] = []
        """Bugs the engines contained (`InternalError`): a finding, though nothing leaked."""
        self._by_id: dict[tuple[str, str], PairedRequest] = {}
        self._owed: dict[str, set[str]] = {}  # request key -> agents that still owe a release
        self._released: Counter[tuple[str, str]] = Counter()
        self._failed: set[tuple[str, str]] = set()
        self._received: set[tuple[str, str]] = set()
        self._freed: set[tuple[str, str]] = set()
        self._late_posts: set[tuple[str, str, str]] = set()
        self.finals: Counter[str] = Counter()
        self.verified_bytes = 0
        self._holding: dict[str, Counter[int]] = {}  # agent -> blocks its live requests hold
        cluster.network.on_bytes = self.bytes_landed  # the simulated fabric's every copy

    def admitted(self, pr: PairedRequest) -> None:
        """Both sides' live ranks owe one release of the request's blocks."""
        owed = set()
        for side, rid, blocks in (("P", pr.p_id, pr.p_blocks), ("D", pr.d_id, pr.d_blocks)):
            for agent in self.cluster.agents(side):
                if agent not in self.cluster.dead:
                    self._by_id[(agent, rid)] = pr
                    owed.add(agent)
                    self._holding.setdefault(agent, Counter()).update(blocks.tolist())
        self._owed[pr.key] = owed

    def request_of(self, agent: str, request_id: str) -> PairedRequest | None:
        """The paired request an engine's output is about."""
        return self._by_id.get((agent, request_id))

    def forget_engine(self, agent: str) -> None:
        """A dead engine's requests died with it: it owes nothing any more."""
        self._holding.pop(agent, None)
        for key, owed in self._owed.items():
            if agent in owed:
                owed.discard(agent)
                self._maybe_free(self.cluster.requests[key])

    def released(self, agent: str, pr: PairedRequest, out: ReleaseBlocks | ReportReceived) -> None:
        """An engine handed a request's blocks back: check properties 2, 3, 4, count for 5."""
        side = agent.split("#")[0]
        self._released[(agent, pr.key)] += 1
        if self._released[(agent, pr.key)] > 1:
            self._violate(f"no leak: {agent} released {pr.key} twice")
        else:
            held = self._holding.get(agent, Counter())
            held.subtract((pr.p_blocks if side == "P" else pr.d_blocks).tolist())
        if side == "P":
            self._check_no_early_free(agent, pr)
        else:
            self._check_no_late_write(agent, pr)
        if isinstance(out, ReportReceived):
            self._check_bytes(agent, pr)
        owed = self._owed.get(pr.key, set())
        owed.discard(agent)
        self._maybe_free(pr)

    def failed(self, agent: str, pr: PairedRequest) -> None:
        """D reported the request's blocks invalid."""
        if (agent, pr.key) in self._received:
            self._violate(f"no silent corruption: {agent} reported {pr.key} received, then failed")
        self._failed.add((agent, pr.key))

    def finished(self, agent: str, pr: PairedRequest, state: str) -> None:
        """A request ended on an engine: check what it reported matches how it ended."""
        self.finals[f"{agent.split('#')[0]}:{state}"] += 1
        released = self._released[(agent, pr.key)]
        held = released == 0 and self._holds(agent, pr)  # released once late bytes cannot land
        if released != 1 and not held:
            self._violate(f"no leak: {agent} ended {pr.key} ({state}) without releasing once")
        if agent.startswith("D"):
            received = (agent, pr.key) in self._received
            failed = (agent, pr.key) in self._failed
            if (state == "done") != received:
                self._violate(
                    f"no silent corruption: {agent} {pr.key} {state}, received={received}"
                )
            if state in ("failed", "expired") and not failed:
                self._violate(
                    f"no silent corruption: {agent} {pr.key} {state} without invalid blocks"
                )

    def quiescence(self) -> list[str]:
        """Properties 1 and 5 once the cluster settled: nothing live, nothing owed, nothing held."""
        problems = self.violations + self.internal_errors
        for key, owed in self._owed.items():
            for agent in owed:
                problems.append(f"terminal/no leak: {agent} never released {key}")
        for engine in self.cluster.live_engines():
            side = engine.side
            if side.requests:
                states = {rid: r.state for rid, r in list(side.requests.items())[:5]}
                problems.append(f"terminal: {engine.agent} still holds {states}")
            if engine.inflight or len(side.deadlines) or len(side.quarantine):
                problems.append(f"no leak: {engine.agent} holds transfers, deadlines or blocks")
        return problems

    # --- the checks ------------------------------------------------------------------------------

    def _moving(self) -> Iterator[tuple[Engine, InFlight]]:
        """Transfers the fabric still moves (an engine may not have polled a finished one yet)."""
        for engine in self.cluster.live_engines():
            for flight in engine.inflight.values():
                try:
                    moving = engine.fabric.check_xfer_state(flight.handle) == "PROC"
                except FabricError:
                    moving = False
                if moving:
                    yield engine, flight

    def check_posts(self) -> None:
        """A transfer posted after the other side released the request's blocks: a WRITE into
        D's released blocks (no late write) or a READ from P's (no early free)."""
        for engine in self.cluster.live_engines():
            for flight in engine.inflight.values():
                pr = self.request_of(engine.agent, flight.request_id)
                if pr is None or self._released[(flight.peer, pr.key)] == 0:
                    continue
                seen = (engine.agent, flight.request_id, flight.peer)
                if seen not in self._late_posts:
                    self._late_posts.add(seen)
                    rule = "no late write" if flight.op == "WRITE" else "no early free"
                    self._violate(
                        f"{rule}: {engine.agent} posted a {flight.op} for {pr.key} "
                        f"after {flight.peer} released its blocks"
                    )

    def bytes_landed(
        self, into: str, written: list[tuple[int, int]], out: str, read: list[tuple[int, int]]
    ) -> None:
        """The simulated fabric moved bytes (at any latency, inside a post too): they may land
        only in blocks a live request holds on D's side (no late write) and come only from
        blocks one holds on P's (no early free)."""
        for agent, ranges, rule in ((into, written, "no late write"), (out, read, "no early free")):
            loose = self._unheld_blocks(agent, ranges)
            if loose:
                verb = "landed in" if rule == "no late write" else "were read from"
                self._violate(f"{rule}: bytes {verb} {agent}'s blocks {loose}, held by no request")

    def _unheld_blocks(self, agent: str, ranges: list[tuple[int, int]]) -> list[int]:
        engine = self.cluster.engines.get(agent)
        if engine is None or not ranges:
            return []
        held, kv = self._holding.get(agent, Counter()), engine.kv
        touched: set[int] = set()
        g = kv.geometry
        stride, size = g.block_stride, g.block_stride * g.num_blocks  # a region's extent
        for region in kv.regions():
            base = region.ctypes.data
            for start, end in ranges:
                # With interleaved regions a range in another layer's page is not this one's.
                if base <= start < base + size and (start - base) % stride < g.block_len:
                    touched.update(range((start - base) // stride, (end - 1 - base) // stride + 1))
        return sorted(b for b in touched if held[b] <= 0)

    def _check_no_early_free(self, agent: str, pr: PairedRequest) -> None:
        for engine, flight in self._moving():
            reads_p = (engine.agent == agent and flight.request_id == pr.p_id) or (
                flight.peer == agent and flight.request_id == pr.d_id
            )
            if reads_p:
                self._violate(f"no early free: {agent} freed {pr.key} under {flight.op}")

    def _check_no_late_write(self, agent: str, pr: PairedRequest) -> None:
        for engine, flight in self._moving():
            into_d = (flight.peer == agent and flight.request_id == pr.p_id) or (
                engine.agent == agent and flight.request_id == pr.d_id
            )
            if into_d:
                self._violate(f"no late write: {agent} released {pr.key} under {flight.op}")
        late = self.cluster.network.late_writes_into(agent) if len(pr.d_blocks) else []
        if late and _overlaps(late, self.cluster.engines[agent].kv, pr.d_blocks):
            self._violate(f"no late write: {agent} released {pr.key} with bytes still due")

    def _holds(self, agent: str, pr: PairedRequest) -> bool:
        engine = self.cluster.engines.get(agent)
        rid = pr.p_id if agent.startswith("P") else pr.d_id
        return engine is not None and engine.side.quarantine.holds(rid)

    def _check_bytes(self, agent: str, pr: PairedRequest) -> None:
        self._received.add((agent, pr.key))
        if (agent, pr.key) in self._failed:
            self._violate(f"no silent corruption: {agent} reported {pr.key} failed, then received")
        if not len(pr.d_blocks):
            return
        cluster = self.cluster
        p_bs = cluster.geometry["P"].block_size
        d_bs = cluster.geometry["D"].block_size
        tokens = len(pr.p_blocks) * p_bs
        first = (-(-tokens // d_bs) - len(pr.d_blocks)) * d_bs  # D's prefix-cache hit
        check = check_request(
            cluster.engines[agent].kv,
            request_seed(pr.p_id),
            pr.d_blocks,
            unit_tokens=cluster.unit_tokens,
            first_token=first,
            tokens=tokens - first,
        )
        if check.wrong or not check.compared:
            self._violate(f"no silent corruption: {agent} received wrong bytes for {pr.key}")
        else:
            self.verified_bytes += check.compared

    def _maybe_free(self, pr: PairedRequest) -> None:
        owed = self._owed.get(pr.key)
        if owed is None:
            return
        for side, blocks in (("P", pr.p_blocks), ("D", pr.d_blocks)):
            if not any(a.startswith(side) for a in owed) and (pr.key, side) not in self._freed:
                self._freed.add((pr.key, side))
                self._poison(side, blocks)
                self.cluster.free(side, blocks)

    def _poison(self, side: str, blocks: np.ndarray) -> None:
        """Overwrite freed P blocks, as the next prefill would: a READ that lands after the free
        then brings bytes that fail the integrity check."""
        if side != "P" or not len(blocks):
            return
        for engine in self.cluster.live("P"):
            engine.kv.fill_blocks(blocks, 0xEE)

    def _violate(self, message: str) -> None:
        self.violations.append(message)


def _overlaps(ranges: list[tuple[int, int]], kv: KvCache, blocks: np.ndarray) -> bool:
    """Whether any byte range [start, end) (host addresses) touches one of `blocks` in `kv`."""
    g = kv.geometry
    for region in kv.regions():
        starts = region.ctypes.data + blocks.astype(np.int64) * g.block_stride
        for start, end in ranges:
            if np.any((starts < end) & (start < starts + g.block_len)):
                return True
    return False
