"""The connector's worker half: one kvfsm engine (core, NIXL agent, engine loop) per worker rank.

vLLM calls it from the model runner's thread; the engine runs on its own loop thread. What the
core reports (blocks released, received, failed; finished traces) is gathered here under a lock
and handed to vLLM at its next `get_finished` / `get_block_ids_with_load_errors` /
`get_kv_connector_stats`.

The failure contract: the core reports a failed load (`ReportFailed`, with the request's blocks)
before it lets the blocks go (`ReleaseBlocks`), and both land here in that order, so a load's
invalid blocks are always handed to vLLM no later than the step that reports it finished. With
several KV cache groups (block ids mean nothing without their group) a failed load is handed
over as the request's id in `failed_recving` instead, failing every group's blocks.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvfsm.core import (
    Admit,
    Consumer,
    Event,
    Identity,
    InternalError,
    Producer,
    ReleaseBlocks,
    ReportFailed,
    ReportReceived,
)
from kvfsm.fabric import NixlFabric, buffer_span
from kvfsm.layout import KvGeometry
from kvfsm.runtime import (
    CallerOutput,
    Engine,
    EngineLoop,
    KvCache,
    RequestTrace,
    status_answerer,
)
from kvfsm.sidechannel import (
    HandshakeListener,
    HandshakePayload,
    ZmqDirectory,
    compat_hash,
    payload_of,
    validate,
)
from kvfsm.vllm._fence import DeviceFence
from kvfsm.vllm._geometry import kernel_blocks
from kvfsm.vllm._scheduler import ConnectorStep
from kvfsm.vllm._settings import KvfsmSettings
from kvfsm.vllm._stats import StatsWindow
from kvfsm.wire import WIRE_VERSION

__all__ = ["WorkerSide"]
_log = logging.getLogger("vllm.kvfsm")  # under vLLM's logging configuration
# The engine's counters of notifications it dropped unheard (docs/security.md).
_REFUSALS = ("replayed", "unauthenticated", "stranger")
_SIDE_COUNTS = (
    "corrupted",
    "verified",
    "recovered",
    "goodbyes",
)  # the core's counters vLLM's metrics carry


class WorkerSide:
    """The worker half of one rank: created at `register_kv_caches`, closed at `shutdown`."""

    def __init__(
        self,
        settings: KvfsmSettings,
        *,
        is_producer: bool,
        identity: Identity,
        model: str,
        dtype: str,
        fail_by_request: bool = False,
    ) -> None:
        self.settings = settings
        self.is_producer = is_producer
        self.identity = identity
        self._model, self._dtype = model, dtype
        self.counters: Counter[str] = Counter()
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.payload: HandshakePayload | None = None
        self._directory: ZmqDirectory | None = None
        self._status: HandshakeListener | None = None  # answers peers' questions on transfers
        self._fabric: NixlFabric | None = None
        self._lock = threading.Lock()
        self._awaited: set[str] = set()  # guarded by _lock
        self._reported: Counter[str] = Counter()  # engine counts already in a stats window
        self._sending: set[str] = set()  # guarded by _lock
        self._recving: set[str] = set()  # guarded by _lock
        self._invalid: set[int] = set()  # guarded by _lock
        self._failed: set[str] = set()  # guarded by _lock
        self._fail_by_request = fail_by_request
        self._stats = StatsWindow()  # guarded by _lock
        self._fence: DeviceFence | None = None
        self._split = 1  # kernel blocks per vLLM block
        self.on_report: Callable[[], None] | None = None
        """Called (on the loop thread) when something for vLLM's next step arrived."""

    def start(self, geometry: KvGeometry, buffers: list[Any], kernel_split: int = 1) -> None:
        """Register the KV cache with a NIXL agent and start the engine loop. `kernel_split`:
        kernel blocks per scheduler block (the geometry counts kernel blocks)."""
        self._split = kernel_split
        s, me = self.settings, self.identity
        mem_type = buffer_span(buffers[0]).mem_type
        core = (Producer if self.is_producer else Consumer)(me, s.mode, s.core_config())
        fabric = self._fabric = NixlFabric(
            me.agent, mem_type=mem_type, ucx_error_handling=s.ucx_error_handling
        )
        try:
            kv = KvCache(geometry, buffers)
            chash = compat_hash(
                wire_version=WIRE_VERSION,
                mode=s.mode,
                model=self._model,
                dtype=self._dtype,
                geometry=geometry.for_rank(0),
            )
            check = functools.partial(
                validate, expect_mode=s.mode, local=geometry, local_is_p=self.is_producer
            )
            secret = s.secret()
            self._directory = ZmqDirectory(
                {},
                compat_hash=chash,
                wire_version=WIRE_VERSION,
                timeout_s=s.handshake_timeout_s,
                check=check,
                secret=secret,
                requester=me.agent,
            )
            # No `guests`: the listener runs in the scheduler's process (docs/security.md).
            self.engine = Engine(
                core,
                fabric,
                kv,
                self._directory,
                time.monotonic,
                secret=secret,
                conformance=s.conformance,
            )
        except BaseException:
            self._close_parts()
            raise
        self.loop = EngineLoop(
            self.engine,
            self._on_output,
            poll_min_s=s.poll_min_us * 1e-6,
            poll_max_s=s.poll_max_us * 1e-6,
            hot_s=None if s.poll_hot_us is None else s.poll_hot_us * 1e-6,
            name=f"kvfsm-{me.agent}",
            logger=_log,
        )
        self._directory.on_result = self.loop.wake
        # Peers ask this rank about transfers whose completion was lost; the handshake listener
        # runs in the scheduler's process, so the rank answers at a listener of its own.
        try:
            self._status = HandshakeListener(
                lambda _agent: None,
                s.side_channel_host,
                secret=secret,
                status=status_answerer(self.loop),
            )
            self.payload = payload_of(
                self.engine,
                compat_hash=chash,
                wire_version=WIRE_VERSION,
                status_contact=self._status.where,
            )
        except BaseException:
            self.loop.stop()
            self._close_parts()
            raise
        if self.is_producer and s.device_fence and mem_type == "VRAM":
            self._fence = DeviceFence(self._submit, f"kvfsm-{me.agent}")
        if s.gil_switch_interval_us > 0:
            sys.setswitchinterval(s.gil_switch_interval_us * 1e-6)
        self.loop.start()
        _log.info("kvfsm %s started: %r, %s", me.agent, kv, s.mode)

    # --- per step, from vLLM's thread ----------------------------------------------------------

    def apply(self, step: ConnectorStep) -> None:
        """Hand this step's events to the engine (in order; the loop thread runs them)."""
        if self.loop is None:
            if step.events:
                raise RuntimeError("kvfsm: events before register_kv_caches")
            return
        if step.refused:
            with self._lock:
                for rid, blocks in step.refused:
                    self._fail(rid, blocks)
                    (self._sending if self.is_producer else self._recving).add(rid)
        for event, awaited in step.events:
            if awaited:
                with self._lock:
                    self._awaited.add(event.request_id)  # type: ignore[union-attr]
        events = [kernel_blocks(event, self._split) for event, _ in step.events]
        if self._fence is not None:
            self._fence.pass_on(events)
            return
        for event in events:
            self._submit(event)

    def written(self) -> None:
        """This step's forward passes are queued (vLLM's `wait_for_save`): on a GPU, what is
        handed over from now on waits for them to run (`DeviceFence`)."""
        if self._fence is not None:
            self._fence.written()

    def _submit(self, event: Event) -> None:
        assert self.loop is not None
        self.loop.submit(event).add_done_callback(functools.partial(self._refused, event))

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose sending / receiving ended since the last call."""
        with self._lock:
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, set()
        return sending or None, recving or None

    def load_errors(self) -> set[int]:
        """Blocks of failed loads since the last call."""
        with self._lock:
            invalid, self._invalid = self._invalid, set()
        return invalid

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """`finished` and, with several KV cache groups, which of the loads failed: a failed
        load is handed over in the same call that reports it received, as vLLM expects."""
        with self._lock:
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, set()
            failed = self._failed & recving
            self._failed -= failed
        return sending, recving, failed

    def _vllm_blocks(self, kernel: Any) -> set[int]:
        """vLLM's block ids of the engine's (kernel) block ids."""
        return {int(b) // self._split for b in kernel}

    def _fail(self, rid: str, blocks: Any) -> None:  # under _lock
        if self._fail_by_request:
            self._failed.add(rid)
        else:
            self._invalid.update(int(b) for b in blocks)

    def stats(self) -> dict[str, Any] | None:
        """Stats since the last call, or None if nothing happened."""
        totals: Counter[str] = Counter()
        state = "serving"
        if self.engine is not None:  # read across threads: single dict lookups, no iteration
            engine, side = self.engine.counters, self.engine.side.counters
            totals["refused_notifications"] = sum(engine[name] for name in _REFUSALS)
            totals.update({name: side[name] for name in _SIDE_COUNTS})
            totals["peers_removed"] = engine["peers_removed"]
            state = self.engine.side.engine.state
        with self._lock:
            window, self._stats = self._stats, StatsWindow()
            window.counts.update(totals - self._reported)
            self._reported = totals
        if state != "serving":  # every step while it drains: the scheduler waits for it
            window.engines[state] += 1
        return None if window.empty else window.data()

    # --- from the loop thread --------------------------------------------------------------------

    def _on_output(self, output: CallerOutput) -> None:
        _log.debug("kvfsm %s: %r", self.identity.agent, output)
        with self._lock:
            if isinstance(output, RequestTrace):
                self._stats.add(output)
                return
            if isinstance(output, InternalError):  # the loop logged it; the requests it hit
                self._stats.counts["internal_errors"] += 1  # report as they end
                return
            if not isinstance(output, ReleaseBlocks | ReportReceived | ReportFailed):
                return
            rid = output.request_id
            if rid not in self._awaited:
                return  # vLLM freed these blocks itself (an abort before P finished, a hit)
            if isinstance(output, ReportFailed):
                self._fail(rid, self._vllm_blocks(output.blocks))
            else:
                self._awaited.discard(rid)
                (self._sending if self.is_producer else self._recving).add(rid)
        if self.on_report is not None:
            self.on_report()

    def _refused(self, event: Event, future: Future[None]) -> None:
        """The core refused an event (e.g. an abort of a request that already ended: harmless).
        If vLLM waits on the request and the core does not hold it, report it now, failed on
        D, so that nothing is held forever."""
        exc = future.exception()
        if exc is None:
            return
        rid = getattr(event, "request_id", None)
        if rid is None:  # a drain the engine had no use for (closed): nothing waits on it
            self.counters["refused_events"] += 1
            return
        engine = self.engine
        with self._lock:
            self.counters["refused_events"] += 1
            orphan = rid in self._awaited and (engine is None or rid not in engine.side.requests)
            if orphan:
                self._awaited.discard(rid)
                if isinstance(event, Admit):
                    self._fail(rid, self._vllm_blocks(event.blocks))
                (self._sending if self.is_producer else self._recving).add(rid)
        _log.log(logging.WARNING if orphan else logging.DEBUG, "kvfsm: %r refused: %s", event, exc)

    def close(self) -> None:
        """Let live transfers end (`drain_s`), then release every NIXL resource."""
        if self._fence is not None:
            self._fence.close()
        if self.loop is not None:
            try:
                self.loop.stop(drain_s=self.settings.drain_s)
            except TimeoutError as exc:
                _log.warning("kvfsm: %s", exc)
            engine = self.loop.engine
            counts = engine.counters + engine.side.counters + self.counters
            _log.info("kvfsm %s closed: %s", self.identity.agent, dict(sorted(counts.items())))
        self._close_parts()

    def _close_parts(self) -> None:
        if self._status is not None:
            self._status.close()
            self._status = None
        if self._directory is not None:
            self._directory.close()
            self._directory = None
        if self._fabric is not None:
            self._fabric.close()
            self._fabric = None
