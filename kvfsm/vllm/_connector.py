"""`KvfsmConnector`: kvfsm as a vLLM (0.32) KV connector, both roles, push or pull.

Load it with
``--kv-transfer-config '{"kv_connector": "KvfsmConnector", "kv_connector_module_path":
"kvfsm.vllm", "kv_role": "kv_producer", "kv_connector_extra_config": {"mode": "pull"}}'``
(`kv_consumer` on D). Every method delegates to the scheduler half (`SchedulerSide`) or the
worker half (`WorkerSide`); this module only adapts vLLM's types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvfsm.core import Identity
from kvfsm.sidechannel import HandshakePayload
from kvfsm.vllm._geometry import REQUIRED_LAYOUT, LayoutError, geometry_of, page_geometry_of
from kvfsm.vllm._groups import KvGroups
from kvfsm.vllm._params import contact_of
from kvfsm.vllm._prom import KvfsmPromMetrics
from kvfsm.vllm._scheduler import ConnectorStep, SchedulerSide
from kvfsm.vllm._settings import KvfsmSettings, SettingsError
from kvfsm.vllm._stats import merge, reduce
from kvfsm.vllm._worker import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = ["KvfsmConnector", "KvfsmHandshake", "KvfsmMetadata", "KvfsmStats"]


class KvfsmMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the core events of the step."""

    def __init__(self, step: ConnectorStep) -> None:
        self.step = step


@dataclass
class KvfsmHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: the rank's handshake payload (msgpack)."""

    payload: bytes


@dataclass
class KvfsmStats(KVConnectorStats):
    """Requests by final state, transfers, bytes and time in state (see `kvfsm.vllm._stats`)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvfsmStats:
        self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce(self.data)

    def is_empty(self) -> bool:
        return not self.data.get("ended") and not self.data.get("engines")


class KvfsmConnector(KVConnectorBase_V1, SupportsHMA):
    """kvfsm's KV connector. P (`kv_producer`) returns vLLM-style `kv_transfer_params` from
    `request_finished`; D (`kv_consumer`) loads from the P they name. See docs/vllm.md."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.settings = KvfsmSettings.from_extra_config(transfer.kv_connector_extra_config)
        self.groups = _refuse_unsupported(vllm_config, kv_cache_config)
        parallel = vllm_config.parallel_config
        self._is_producer = transfer.kv_role == "kv_producer"
        self._tp_size = parallel.tensor_parallel_size
        port = self.settings.side_channel_port + parallel.data_parallel_index
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                self.settings,
                is_producer=self._is_producer,
                engine_id=transfer.engine_id,
                tp_size=self._tp_size,
                port=port,
                groups=self.groups,
            )
        else:
            identity = Identity(
                transfer.engine_id,
                _tp_rank(self._tp_size),
                self._tp_size,
                contact_of(self.settings.side_channel_host, port),
            )
            model = vllm_config.model_config
            self._worker = WorkerSide(
                self.settings,
                is_producer=self._is_producer,
                identity=identity,
                model=f"{_model_identity(model)}:{self.groups.describe()}",
                dtype=str(model.dtype),
                fail_by_request=self.groups.count > 1,
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The KV cache layout kvfsm moves, asked of vLLM: LBHNC for every model (with MLA
        the layer-outermost layouts hold the same bytes). vLLM drops the request, with a
        warning, where the attention backend admits no LBHNC; `register_kv_caches` then
        refuses the layout it got, naming it and the fix (docs/vllm.md)."""
        return REQUIRED_LAYOUT

    # --- worker ----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._need_worker()
        config = self._vllm_config
        if self.groups.has_mamba:
            geometry, buffers = page_geometry_of(
                kv_caches,
                page_bytes=self.groups.page_bytes,
                block_size=self.groups.block_size,
                tp_size=self._tp_size,
                tp_rank=worker.identity.rank,
            )
            worker.start(geometry, buffers)
            return
        block_size = config.cache_config.block_size
        try:
            geometry, buffers = geometry_of(
                kv_caches,
                block_size=block_size,
                num_kv_heads=config.model_config.get_total_num_kv_heads(),
                tp_size=self._tp_size,
                tp_rank=worker.identity.rank,
                mla=bool(getattr(config.model_config, "use_mla", False)),
            )
        except LayoutError as exc:
            raise LayoutError(
                f"{exc} [attention backend: {backends_of(config, kv_caches)}]"
            ) from None
        worker.start(geometry, buffers, kernel_split=block_size // geometry.block_size)

    def get_handshake_metadata(self) -> KvfsmHandshake | None:
        worker = self._need_worker()
        if worker.payload is None:
            return None
        return KvfsmHandshake(msgspec.msgpack.encode(worker.payload))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        # The step's events go to the engine loop now, before the forward pass: P's KV of a
        # finished prefill was written by an earlier step, and a hand-off should not wait for
        # this step's forward (start_load_kv runs after it when no load is synchronous).
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KvfsmMetadata)
        self._need_worker().apply(connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # loads started when the step's metadata was bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None  # P's blocks are read or written in place once the prefill finished

    def wait_for_save(self) -> None:
        # The end of the step's forward on the host: its KV writes are queued (on a GPU, not
        # yet run). What P hands over from the next step on waits for them (DeviceFence).
        self._need_worker().written()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._need_worker().finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return KVConnectorTransferResults(*self._need_worker().results())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._need_worker().load_errors()

    def get_kv_connector_stats(self) -> KvfsmStats | None:
        if self._worker is None:
            return None
        data = self._worker.stats()
        return None if data is None else KvfsmStats(data=data)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()

    # --- scheduler -------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self._need_sched().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._need_sched().allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvfsmMetadata:
        return KvfsmMetadata(self._need_sched().take_step())

    def update_connector_output(self, connector_output: Any) -> None:
        stats = getattr(connector_output, "kv_connector_stats", None)
        self._need_sched().reported(
            connector_output.finished_sending,
            connector_output.finished_recving,
            getattr(stats, "data", None),
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        return self._need_sched().finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Any]:
        return self._need_sched().finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # A load moves the request's own blocks of every transferred group (vLLM then leaves
        # them unzeroed), not only the prefix-cacheable ones.
        return self.groups.ids

    def on_new_request(self, request: Any) -> None:
        self._need_sched().new_request(request)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.pending

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        payloads = [
            msgspec.msgpack.decode(m.payload, type=HandshakePayload) for m in metadata.values()
        ]
        self._need_sched().serve_handshakes(payloads)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvfsmStats:
        return KvfsmStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvfsmPromMetrics:
        return KvfsmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- helpers -----------------------------------------------------------------------------------

    def _need_worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvfsm: a worker method was called on the scheduler's connector")
        return self._worker

    def _need_sched(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("kvfsm: a scheduler method was called on a worker's connector")
        return self._sched


def _refuse_unsupported(vllm_config: Any, kv_cache_config: Any) -> KvGroups:
    """Refuse, at start-up and saying why, what the core cannot move correctly; the KV cache
    groups it moves otherwise."""
    problems = []
    role = vllm_config.kv_transfer_config.kv_role
    if role not in ("kv_producer", "kv_consumer"):
        problems.append(f"kv_role {role!r}: use kv_producer on P and kv_consumer on D")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism is not supported")
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        problems.append("decode context parallelism is not supported")
    groups = KvGroups.single()
    if kv_cache_config is not None:
        try:
            groups = KvGroups.of(kv_cache_config)
        except SettingsError as exc:
            problems.append(str(exc).removeprefix("KvfsmConnector "))
    if problems:
        raise SettingsError("KvfsmConnector cannot run this engine: " + "; ".join(problems))
    return groups


def backends_of(vllm_config: Any, layers: Any) -> str:
    """The names of the attention backends running `layers` (from vLLM's forward context), for
    a start-up refusal to name; "unknown" where vLLM does not say."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    names = set()
    for layer in layers:
        backend = getattr(context.get(layer), "attn_backend", None)
        get_name = getattr(backend, "get_name", None)
        if callable(get_name):
            names.add(str(get_name()))
    return ", ".join(sorted(names)) or "unknown"


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _model_identity(model_config: Any) -> str:
    """What both engines' models must share (their paths may differ)."""
    hf = model_config.hf_config
    archs = ",".join(getattr(hf, "architectures", None) or [])
    sizes = (getattr(hf, n, None) for n in ("vocab_size", "hidden_size", "num_hidden_layers"))
    return f"{archs}:" + ":".join(str(s) for s in sizes)
