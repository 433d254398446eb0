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

import numpy as np

from kvfsm.core import Abort, Admit, Event, PrefillFinished
from kvfsm.sidechannel import HandshakeListener, HandshakePayload
from kvfsm.vllm._params import ParamsError, producer_params, remote_prefill
from kvfsm.vllm._settings import KvfsmSettings
from kvfsm.wire import BlockIds

__all__ = ["ConnectorStep", "SchedulerSide"]

_log = logging.getLogger("vllm.kvfsm")  # under vLLM's logging configuration

_SENT = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")  # P finished its prefill normally


class ConnectorStep:
    """One step's core events for every worker, in order, each with whether the scheduler waits
    for the worker to report the request (`finished_sending`/`finished_recving`)."""

    def __init__(self, events: list[tuple[Event, bool]]) -> None:
        self.events = events

    def __repr__(self) -> str:
        return f"ConnectorStep({self.events!r})"


class SchedulerSide:
    """The scheduler half for one engine: P (`kv_producer`) or D (`kv_consumer`)."""

    def __init__(
        self, settings: KvfsmSettings, *, is_producer: bool, engine_id: str, tp_size: int,
        port: int,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.is_producer = is_producer
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.port = port
        self.counters: Counter[str] = Counter()
        self.listener: HandshakeListener | None = None
        self._events: list[tuple[Event, bool]] = []
        self._admitted: set[str] = set()  # P: admitted, prefill not yet finished
        self._awaited: set[str] = set()  # P: finished_sending; D: finished_recving pending

    # --- both ----------------------------------------------------------------------------------

    def serve_handshakes(self, payloads: Sequence[HandshakePayload]) -> None:
        """Start the listener answering for every rank of this engine (once)."""
        if self.listener is not None:
            return
        by_agent = {p.agent: p for p in payloads}
        host = self.settings.side_channel_host
        try:
            self.listener = HandshakeListener(
                by_agent.get, host, self.port, secret=self.settings.secret()
            )
        except Exception as exc:
            raise RuntimeError(
                f"kvfsm: cannot listen for handshakes on {host}:{self.port} ({exc}); set"
                f" side_channel_host/side_channel_port in kv_connector_extra_config"
            ) from exc
        _log.info("kvfsm %s answers handshakes at %s", self.engine_id, self.listener.where)

    def take_step(self) -> ConnectorStep:
        """The events gathered since the last step."""
        events, self._events = self._events, []
        return ConnectorStep(events)

    def reported(self, sending: set[str] | None, recving: set[str] | None) -> None:
        """The workers reported these requests; the scheduler frees or resumes them."""
        self._awaited.difference_update(sending or ())
        self._awaited.difference_update(recving or ())

    @property
    def pending(self) -> bool:
        """Requests still wait on a worker report: vLLM must keep stepping."""
        return bool(self._awaited)

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
        try:
            remote_prefill(params, self.settings.mode)
        except ParamsError as exc:
            self.counters["bad_params"] += 1
            _log.warning("kvfsm: request %s computes locally: %s", request.request_id, exc)
            params["do_remote_prefill"] = False
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Blocks were allocated: P admits the prefill; D admits the load (or, with nothing to
        load, tells P to let go)."""
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if self.is_producer:
            if params.get("do_remote_decode") and rid not in self._admitted:
                self._admitted.add(rid)
                self._events.append((Admit(rid, _ids(blocks.get_block_ids())), False))
        elif params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False  # one load per request, as vLLM's connectors
            ids = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
            self._admit_load(rid, params, ids)

    def _admit_load(self, rid: str, params: dict[str, Any], block_ids: list[int]) -> None:
        try:
            p = remote_prefill(params, self.settings.mode)
        except ParamsError:  # counted when first seen; an unscheduled request just goes
            return
        awaited = bool(block_ids)
        if awaited:
            self._awaited.add(rid)
        admit = Admit(
            rid, _ids(block_ids), p.remote_engine_id, p.tp_size, p.remote_request_id, p.contact
        )
        self._events.append((admit, awaited))

    # --- finished ------------------------------------------------------------------------------

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished the request: (free its blocks later?, params for the client)."""
        rid, params = request.request_id, request.kv_transfer_params
        if not params:
            return False, None
        if not self.is_producer:
            if params.get("do_remote_prefill"):  # never scheduled: release P's blocks now
                params["do_remote_prefill"] = False
                self._admit_load(rid, params, [])
            elif rid in self._awaited:  # still loading: abort; vLLM frees on finished_recving
                # (the worker already waits to report it: the abort adds nothing to wait for,
                # and the load may even have been reported in this very step)
                self._events.append((Abort(rid), False))
            return False, None
        if rid not in self._admitted:
            return False, None
        self._admitted.discard(rid)
        if request.status.name not in _SENT or not block_ids:
            self._events.append((Abort(rid), False))
            return False, None
        self._awaited.add(rid)
        self._events.append((PrefillFinished(rid, _ids(block_ids)), True))
        s = self.settings
        return True, producer_params(
            request_id=rid, block_ids=list(block_ids), engine_id=self.engine_id,
            host=s.side_channel_host, port=self.port, tp_size=self.tp_size,
            num_tokens=request.num_computed_tokens, mode=s.mode,
        )  # fmt: skip


def _ids(blocks: Any) -> BlockIds:
    """vLLM's block ids (a list, or one list per KV cache group) as the core's array."""
    if isinstance(blocks, tuple):
        (blocks,) = blocks  # one KV cache group: checked at start-up
    return np.asarray(blocks, dtype=np.int32)
