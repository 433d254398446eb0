"""The connector's scheduler half: turns vLLM's scheduling decisions into core events for the
workers, answers handshakes for every rank, and never holds a request beyond its lifecycle.

It keeps no request state of its own beyond two sets whose entries leave when the workers
report the request (the core on each rank owns the lifecycle): P's requests awaiting
`finished_sending` and D's awaiting `finished_recving`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvfsm.core import Abort, Admit, Drain, Event, PrefillFinished
from kvfsm.sidechannel import ControlRequest, HandshakeListener, HandshakePayload
from kvfsm.vllm._groups import KvGroups, joined
from kvfsm.vllm._params import ParamsError, RemotePrefill, producer_params, remote_prefill
from kvfsm.vllm._settings import KvfsmSettings
from kvfsm.wire import BlockIds

__all__ = ["REFUSED_DRAINING", "ConnectorStep", "SchedulerSide"]

_log = logging.getLogger("vllm.kvfsm")  # under vLLM's logging configuration

_SENT = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")  # P finished its prefill normally
REFUSED_DRAINING = {"kvfsm_refused": "draining"}
"""P's `kv_transfer_params` for a prefill it will not hand over (it drains): the proxy sends
the request to another P (docs/vllm.md, "Draining an engine")."""


class ConnectorStep:
    """One step's core events for every worker, in order, each with whether the scheduler waits
    for the worker to report the request (`finished_sending`/`finished_recving`); and D's loads
    refused before they began (request id, blocks), which the workers report failed."""

    def __init__(
        self, events: list[tuple[Event, bool]], refused: list[tuple[str, BlockIds]] | None = None
    ) -> None:
        self.events = events
        self.refused = refused or []

    def __repr__(self) -> str:
        return f"ConnectorStep({self.events!r}, refused={self.refused!r})"


class SchedulerSide:
    """The scheduler half for one engine: P (`kv_producer`) or D (`kv_consumer`)."""

    def __init__(
        self,
        settings: KvfsmSettings,
        *,
        is_producer: bool,
        engine_id: str,
        tp_size: int,
        port: int,
        groups: KvGroups | None = None,
    ) -> None:
        self.settings = settings
        self.groups = groups or KvGroups.single()
        self.is_producer = is_producer
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.port = port
        self.counters: Counter[str] = Counter()
        self.listener: HandshakeListener | None = None
        self._events: list[tuple[Event, bool]] = []
        self._refused: list[tuple[str, BlockIds]] = []
        self._admitted: set[str] = set()  # P: admitted, prefill not yet finished
        self._awaited: set[str] = set()  # P: finished_sending; D: finished_recving pending
        self._promised: set[str] = set()  # D: remote tokens claimed, blocks not yet allocated
        # The drain: asked (from the listener's thread), passed on to the workers, and every
        # rank's core drained (from their stats); `_idle_drained`: asked while nothing was
        # live and no step came to pass it on.
        self.draining = False
        self._drain_sent = False
        self._drained_ranks = False
        self._idle_drained = False

    # --- both ----------------------------------------------------------------------------------

    def serve_handshakes(self, payloads: Sequence[HandshakePayload]) -> None:
        """Start the listener answering for every rank of this engine (once)."""
        if self.listener is not None:
            return
        by_agent = {p.agent: p for p in payloads}
        host = self.settings.side_channel_host
        try:
            self.listener = HandshakeListener(
                by_agent.get,
                host,
                self.port,
                secret=self.settings.secret(),
                on_control=self.control,
            )
        except Exception as exc:
            raise RuntimeError(
                f"kvfsm: cannot listen for handshakes on {host}:{self.port} ({exc}); set"
                f" side_channel_host/side_channel_port in kv_connector_extra_config"
            ) from exc
        _log.info("kvfsm %s answers handshakes at %s", self.engine_id, self.listener.where)

    def control(self, request: ControlRequest) -> str:
        """An operator's request (on the listener's thread): drain, or status; the state."""
        if request.op == "drain" and not self.draining:
            _log.info("kvfsm %s drains: no new remote prefill or load is taken", self.engine_id)
            self.draining = True
        return self.drain_state

    @property
    def drain_state(self) -> str:
        """serving, draining, or drained (every rank drained: nothing live, peers told; or
        nothing was live when asked, and the goodbyes go at shutdown)."""
        if not self.draining:
            return "serving"
        if self._drained_ranks or self._idle_drained:
            return "drained"
        if not (self._drain_sent or self._awaited or self._admitted or self._promised):
            self._idle_drained = True
            return "drained"
        return "draining"

    def take_step(self) -> ConnectorStep:
        """The events gathered since the last step (and the drain, once asked)."""
        if self.draining and not self._drain_sent:
            self._drain_sent = True
            self._events.append((Drain(), False))
        events, self._events = self._events, []
        refused, self._refused = self._refused, []
        return ConnectorStep(events, refused)

    def reported(
        self, sending: set[str] | None, recving: set[str] | None, stats: Any = None
    ) -> None:
        """The workers reported these requests; the scheduler frees or resumes them. `stats`:
        their stats data, whose `engines` say how many ranks are drained."""
        self._awaited.difference_update(sending or ())
        self._awaited.difference_update(recving or ())
        engines = (stats or {}).get("engines", {})
        if self._drain_sent and engines.get("drained", 0) >= self.tp_size:
            self._drained_ranks = True

    @property
    def pending(self) -> bool:
        """Requests still wait on a worker report, or the drain on the ranks: vLLM must keep
        stepping (an idle engine core steps only while this holds)."""
        return bool(self._awaited) or (self._drain_sent and not self._drained_ranks)

    def close(self) -> None:
        """Stop answering handshakes."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    # --- D -------------------------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """D: tokens to load from P (asynchronously), or none. Params that cannot name a P
        request are dropped here, so vLLM computes the prompt itself (P's lease frees P)."""
        params = request.kv_transfer_params
        if self.is_producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        if self.draining:  # vLLM computes the prompt; P's lease (or its own drain) frees P
            self.counters["computed_draining"] += 1
            params["do_remote_prefill"] = False
            return 0, False
        try:
            remote_prefill(params, self.settings.mode)
        except ParamsError as exc:
            self.counters["bad_params"] += 1
            _log.warning("kvfsm: request %s computes locally: %s", request.request_id, exc)
            params["do_remote_prefill"] = False
            return 0, False
        if num_computed_tokens and self.groups.hybrid:
            # The transfer pairs every group's blocks from the request's start; after a local
            # prefix hit D computes the rest itself (P's blocks are let go at allocation).
            self.counters["local_hit_computed"] += 1
            return 0, False
        prompt = len(request.prompt_token_ids or ())
        count = prompt - min(self.groups.prompt_backoff, prompt - 1) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._promised.add(request.request_id)
        return count, True

    def new_request(self, request: Any) -> None:
        """P, with a Mamba group: prefill all but the prompt's last token (vLLM's convention,
        D computes it from the moved state); a rescheduled request is not cut twice."""
        params = request.kv_transfer_params
        backoff = self.groups.prompt_backoff
        if not (self.is_producer and backoff and params and params.get("do_remote_decode")):
            return
        if params.get("_kvfsm_cut") or request.num_prompt_tokens <= backoff:
            return
        if request.prompt_token_ids is None:
            return  # prompt embeddings: P prefills them whole and D loads nothing it lacks
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        params["_kvfsm_cut"] = True

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Blocks were allocated: P admits the prefill; D admits the load (or, with nothing to
        load, tells P to let go)."""
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if self.is_producer:
            if self.draining:
                return  # not admitted: `finished` answers with REFUSED_DRAINING
            if params.get("do_remote_decode") and rid not in self._admitted:
                self._admitted.add(rid)
                admit = Admit(rid, self.groups.blocks(blocks.get_block_ids()))
                self._events.append((admit, False))
        elif params.get("do_remote_prefill"):
            self._promised.discard(rid)
            params["do_remote_prefill"] = False  # one load per request, as vLLM's connectors
            ids = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else []
            tokens = request.num_computed_tokens + num_external_tokens  # once loaded
            self._admit_load(rid, params, ids, tokens)

    def _admit_load(
        self, rid: str, params: dict[str, Any], block_ids: Any, tokens: int = 0
    ) -> None:
        try:
            p = remote_prefill(params, self.settings.mode)
        except ParamsError:  # counted when first seen; an unscheduled request just goes
            return
        groups = self.groups.cut(tuple(block_ids), tokens)
        ids = joined(groups)
        if self.draining:  # the core admits nothing: a load already promised fails (recompute)
            if ids.size:
                self._awaited.add(rid)
                self._refused.append((rid, ids))
            return
        awaited = bool(ids.size)
        if awaited:
            self._awaited.add(rid)
        if awaited and self.groups.hybrid and not self._pairs(rid, p, groups):
            # P is let go (no blocks to fill) and vLLM gets the load as failed.
            self._refused.append((rid, ids))
            ids, awaited = ids[:0], False
        admit = Admit(rid, ids, p.remote_engine_id, p.tp_size, p.remote_request_id, p.contact)
        self._events.append((admit, awaited))

    def _pairs(self, rid: str, p: RemotePrefill, groups: list[list[int]]) -> bool:
        """D's blocks pair with P's group by group (the transfer pairs them from the end)."""
        mine = [len(group) for group in groups]
        if p.kvfsm_group_blocks == mine:
            return True
        self.counters["group_mismatch"] += 1
        _log.warning(
            "kvfsm: request %s fails its load: P moves %s blocks per KV cache group, D holds %s",
            rid,
            p.kvfsm_group_blocks,
            mine,
        )
        return False

    # --- finished ------------------------------------------------------------------------------

    def finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished the request: (free its blocks later?, params for the client).
        `block_ids`: one list per KV cache group (or one list with a single group)."""
        rid, params = request.request_id, request.kv_transfer_params
        if not params:
            return False, None
        if not self.is_producer:
            if params.get("do_remote_prefill"):  # never scheduled: release P's blocks now
                self._promised.discard(rid)
                params["do_remote_prefill"] = False
                self._admit_load(rid, params, [])
            elif rid in self._awaited:  # still loading: abort; vLLM frees on finished_recving
                # (the worker already waits to report it: the abort adds nothing to wait for,
                # and the load may even have been reported in this very step)
                self._events.append((Abort(rid), False))
            return False, None
        if rid not in self._admitted:
            refused = self.draining and params.get("do_remote_decode")
            return False, (dict(REFUSED_DRAINING) if refused else None)
        self._admitted.discard(rid)
        groups = self.groups.cut(block_ids, request.num_computed_tokens)
        moved = joined(groups)
        if request.status.name not in _SENT or not moved.size or self.draining:
            # Draining: nothing is handed over any more; the proxy sends it to another P.
            self._events.append((Abort(rid), False))
            return False, (dict(REFUSED_DRAINING) if self.draining else None)
        self._awaited.add(rid)
        self._events.append((PrefillFinished(rid, moved), True))
        s = self.settings
        return True, producer_params(
            request_id=rid,
            block_ids=[int(b) for b in moved],
            engine_id=self.engine_id,
            host=s.side_channel_host,
            port=self.port,
            tp_size=self.tp_size,
            num_tokens=request.num_computed_tokens,
            mode=s.mode,
            group_blocks=[len(g) for g in groups] if self.groups.hybrid else None,
        )
