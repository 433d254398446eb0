"""Drive a real vLLM 0.32 `Scheduler` with fake model outputs and in-process worker connectors.

No model runs. `Driver.step()` does what `EngineCore.step()` does on this CPU machine (sync
`Scheduler`; `MultiprocExecutor`, so a `KVOutputAggregator` even for one worker; V1 model runner):
schedule, run each worker connector through the calls the model runner makes, aggregate, process
aborts that arrived mid-step, `Scheduler.update_from_output`. Per step and worker connector, as
vllm/v1/worker/gpu_model_runner.py `execute_model` and kv_connector_model_runner_mixin.py
`_get_kv_connector_output` order them (a step with no scheduled tokens has no layer calls):

    handle_preemptions(meta)
    bind_connector_metadata(meta)        # inside set_forward_context(None, vllm_config)
    start_load_kv(fwd_ctx)               # here only if sched_out.has_sync_kv_loads
    wait_for_layer_load(layer); save_kv_layer(layer, kv, None)   # per layer, forward steps only
    start_load_kv(fwd_ctx)               # here otherwise: after the forward
    wait_for_save()
    get_transfer_results(sched_out.finished_req_ids)   # the base class calls get_finished
    get_block_ids_with_load_errors(); get_kv_connector_stats()
    get_kv_connector_kv_cache_events(); build_connector_worker_meta()
    clear_connector_metadata()

Set HF_HUB_OFFLINE=1 before importing vLLM (tests/vllm/conftest.py does).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import pytest
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.forward_context import ForwardContext, get_forward_context, set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

SAMPLED_TOKEN_ID = 7
"""The token every fake forward pass samples for a request whose prompt is complete."""

LAYER_NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
"""The attention layer names vLLM gives the tiny Llama's two layers."""
_LAYER_TYPES = ("sliding_attention", "full_attention")

CPU_KV_CACHE_LAYOUT = "LBHNC"
"""The only layout vLLM 0.32's CPU attention backend supports (`supported_kv_cache_layouts`)."""

BlockHasher = Callable[[Request], list[BlockHash]]

# fmt: off
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
# fmt: on


def write_tiny_config(path: Path, sliding_window: int | None = None) -> Path:
    """Write only `config.json` for a tiny Llama into directory `path`; return `path`. With
    `sliding_window`, layer 0 attends within that many tokens (two KV cache groups)."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_LLAMA_CONFIG)
    if sliding_window is not None:
        config |= {"sliding_window": sliding_window, "layer_types": list(_LAYER_TYPES)}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, sliding_window: int | None = None
) -> Path:
    """A fresh directory holding the tiny Llama's `config.json` (call from a fixture)."""
    return write_tiny_config(tmp_path_factory.mktemp("tiny_llama"), sliding_window)


def _kv_transfer_config(
    config: KVTransferConfig | Mapping[str, Any] | None,
    policy: Literal["fail", "recompute"] | None,
) -> KVTransferConfig | None:
    # A copy: the caller's KVTransferConfig stays as it was.
    if config is None:
        return None
    fields = dict(config) if isinstance(config, Mapping) else asdict(config)
    if policy is not None:
        fields["kv_load_failure_policy"] = policy
    return KVTransferConfig(**fields)


def make_vllm_config(
    model_dir: Path,
    kv_transfer_config: KVTransferConfig | Mapping[str, Any] | None,
    *,
    block_size: int = 32,
    num_gpu_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    enable_prefix_caching: bool = True,
    kv_load_failure_policy: Literal["fail", "recompute"] | None = None,
) -> VllmConfig:
    """A CPU `VllmConfig` (float32, eager, sync scheduling) for the config.json in `model_dir`.

    `kv_transfer_config` may be a dict of its fields; `kv_load_failure_policy`, when given,
    overrides its policy (vLLM's default: "fail"). This imports the connector's module.
    """
    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=model_config.max_model_len,
        is_encoder_decoder=False,
        async_scheduling=False,  # the CPU platform forces this too
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    # The engine core resolves the layout before connectors exist; vLLM's tests pre-set it.
    cache_config.kv_cache_layout = CPU_KV_CACHE_LAYOUT
    cache_config.num_gpu_blocks = num_gpu_blocks
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=_kv_transfer_config(kv_transfer_config, kv_load_failure_policy),
    )


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """One full-attention group holding both layers, `num_blocks` blocks (as vLLM's tests do);
    with a sliding window, layer 0's sliding-window group and layer 1's full-attention group,
    overlaid on one tensor as vLLM's hybrid allocator lays them out."""
    model_config = vllm_config.model_config
    shape = {
        "block_size": vllm_config.cache_config.block_size,
        "num_kv_heads": model_config.get_num_kv_heads(vllm_config.parallel_config),
        "head_size": model_config.get_head_size(),
        "dtype": torch.float32,
    }
    window = getattr(model_config.hf_config, "sliding_window", None)
    groups = [KVCacheGroupSpec(list(LAYER_NAMES), FullAttentionSpec(**shape))]
    if window is not None:
        groups = [
            KVCacheGroupSpec([LAYER_NAMES[0]], SlidingWindowSpec(**shape, sliding_window=window)),
            KVCacheGroupSpec([LAYER_NAMES[1]], FullAttentionSpec(**shape)),
        ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        kv_cache_layout=CPU_KV_CACHE_LAYOUT,
    )


def make_scheduler(
    vllm_config: VllmConfig, num_blocks: int | None = None, *, log_stats: bool = True
) -> Scheduler:
    """A real `Scheduler`; it creates its own scheduler-role connector through vLLM's factory.

    `num_blocks` defaults to `cache_config.num_gpu_blocks`; block 0 is vLLM's null block.
    """
    num_blocks = num_blocks or vllm_config.cache_config.num_gpu_blocks or 64
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = make_kv_cache_config(vllm_config, num_blocks)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size  # as EngineCore sets it
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=log_stats,
    )


def make_worker_connector(scheduler: Scheduler) -> KVConnectorBase_V1:
    """A worker-role instance of the scheduler's connector class, built by vLLM's factory.

    The caller registers KV caches (`register_kv_caches(make_cpu_kv_caches(scheduler))`) if its
    connector needs them; a real worker does so at start-up, before any step.
    """
    connector = KVConnectorFactory.create_connector(
        config=scheduler.vllm_config,
        role=KVConnectorRole.WORKER,
        kv_cache_config=scheduler.kv_cache_config,
    )
    assert isinstance(connector, KVConnectorBase_V1)
    return connector


def make_cpu_kv_caches(scheduler: Scheduler) -> dict[str, torch.Tensor]:
    """Zeroed per-layer KV tensors in the CPU backend's LBHNC shape.

    Shape `(num_blocks, num_kv_heads, block_size, 2 * head_dim)`: each token's K then V per
    head, as kvfsm.vllm._geometry reads vLLM 0.32's CPU cache.
    """
    config = scheduler.kv_cache_config
    spec = config.kv_cache_groups[0].kv_cache_spec
    assert isinstance(spec, FullAttentionSpec | SlidingWindowSpec)
    shape = (config.num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
    if len(config.kv_cache_groups) > 1:  # one layer of each group overlaid on one tensor
        shared = torch.zeros(shape, dtype=spec.dtype)
        return dict.fromkeys(LAYER_NAMES, shared)
    return {name: torch.zeros(shape, dtype=spec.dtype) for name in LAYER_NAMES}


def make_block_hasher(block_size: int = 32, algo: str = "sha256") -> BlockHasher:
    """The block hasher EngineCore gives every request (prefix caching needs it)."""
    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)  # process-global, as in EngineCore; sha256 makes it deterministic
    hasher: BlockHasher = get_request_block_hasher(block_size, hash_fn)
    return hasher


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    *,
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    block_hasher: BlockHasher | None = None,
    block_size: int = 32,
) -> Request:
    """A request as EngineCore builds it; `kv_transfer_params` travels in `extra_args`."""
    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra),
        pooling_params=None,
        block_hasher=block_hasher or make_block_hasher(block_size),
    )


class WorkerLike(Protocol):
    """A worker as the driver sees it: a worker-role connector, or None."""

    connector: KVConnectorBase_V1 | None


@dataclass
class WorkerStub:
    """The simplest `WorkerLike`; `kv_caches` feeds `save_kv_layer` on forward steps."""

    connector: KVConnectorBase_V1 | None
    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class EngineStepResult:
    """What one engine step produced; `scheduler_output` is None for a skipped (idle) step."""

    scheduler_output: SchedulerOutput | None
    engine_outputs: dict[int, EngineCoreOutputs] = field(default_factory=dict)
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    # Per finished request, what request_finished(_all_groups) returned.
    kv_transfer_params: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    # Per worker, what its connector reported (None: no connector); then the aggregate.
    worker_outputs: list[KVConnectorOutput | None] = field(default_factory=list)
    kv_connector_output: KVConnectorOutput | None = None
    aborted: list[str] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        """True when EngineCore would not have stepped at all."""
        return self.scheduler_output is None


class HarnessTimeout(AssertionError):
    """`Driver.run_until` ran out of steps."""


def _fake_sampled(
    scheduler: Scheduler, sched_out: SchedulerOutput, token: int
) -> ModelRunnerOutput:
    # After schedule() a request's num_computed_tokens includes this step's chunk; a runner
    # samples only for requests whose prompt that chunk completes (others get []).
    req_ids = list(sched_out.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[rid].is_prefill_chunk else [token] for rid in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _collect_outputs(
    connector: KVConnectorBase_V1, sched_out: SchedulerOutput
) -> KVConnectorOutput:
    results = connector.get_transfer_results(sched_out.finished_req_ids)
    return KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        failed_recving=results.failed_recving,
        invalid_block_ids=connector.get_block_ids_with_load_errors(),
        kv_connector_stats=connector.get_kv_connector_stats(),
        kv_cache_events=connector.get_kv_connector_kv_cache_events(),
        kv_connector_worker_meta=connector.build_connector_worker_meta(),
    )


def _layer_hooks(worker: WorkerLike, connector: KVConnectorBase_V1) -> None:
    # The attention layers' maybe_transfer_kv_layer hooks. No model runs, so attn_metadata is
    # None here (a real forward passes the backend's metadata object).
    kv_caches: Mapping[str, torch.Tensor] = getattr(worker, "kv_caches", None) or {}
    for name in LAYER_NAMES:
        connector.wait_for_layer_load(name)
        connector.save_kv_layer(name, kv_caches.get(name, torch.empty(0)), None)


def run_worker_step(
    worker: WorkerLike, sched_out: SchedulerOutput, vllm_config: VllmConfig, *, layer_hooks: bool
) -> KVConnectorOutput | None:
    """One worker's connector calls for one step, in the model runner's order."""
    connector = worker.connector
    if connector is None:
        return None
    meta = sched_out.kv_connector_metadata
    assert meta is not None, "the scheduler built no connector metadata"
    connector.handle_preemptions(meta)
    forward = sched_out.total_num_scheduled_tokens > 0
    with set_forward_context(None, vllm_config):
        fwd_ctx: ForwardContext = get_forward_context()
        connector.bind_connector_metadata(meta)
        if sched_out.has_sync_kv_loads:
            connector.start_load_kv(fwd_ctx)
        if forward and layer_hooks:
            _layer_hooks(worker, connector)
        if not sched_out.has_sync_kv_loads:
            connector.start_load_kv(fwd_ctx)
        connector.wait_for_save()
        output = _collect_outputs(connector, sched_out)
        connector.clear_connector_metadata()
    return output


class Driver:
    """Steps a scheduler and its in-process workers the way EngineCore.step() does."""

    def __init__(
        self,
        scheduler: Scheduler,
        workers: Sequence[WorkerLike] = (),
        *,
        token_id: int = SAMPLED_TOKEN_ID,
        layer_hooks: bool = True,
    ) -> None:
        """`workers` are ranks 0..n-1; rank 0's output is the one the scheduler reads."""
        self.scheduler = scheduler
        self.workers = list(workers)
        self.token_id = token_id
        self.layer_hooks = layer_hooks
        self.history: list[EngineStepResult] = []
        self.aggregator: KVOutputAggregator | None = None
        if scheduler.connector is not None:  # as EngineCore.__init__ does
            self.aggregator = KVOutputAggregator.from_connector(
                scheduler.connector, max(1, len(self.workers))
            )

    def add(self, request: Request) -> None:
        """Add a request, as EngineCore.add_request does."""
        self.scheduler.add_request(request)

    def abort(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Abort between steps, as EngineCore.abort_requests does; returns those aborted."""
        status = RequestStatus.FINISHED_ABORTED
        aborted: list[Request] = self.scheduler.finish_requests(request_ids, status)
        return aborted

    def step(self, *, abort_during_step: Iterable[str] = ()) -> EngineStepResult:
        """One EngineCore.step(); `abort_during_step` ids arrive while the model runs."""
        if not self.scheduler.has_requests():
            result = EngineStepResult(scheduler_output=None)
            self.history.append(result)
            return result
        sched_out = self.scheduler.schedule()
        rank0 = _fake_sampled(self.scheduler, sched_out, self.token_id)
        vllm_config = self.scheduler.vllm_config
        kv_outputs = [
            run_worker_step(w, sched_out, vllm_config, layer_hooks=self.layer_hooks)
            for w in self.workers
        ]
        model_output = self._aggregate(kv_outputs, rank0)
        aborted = [r.request_id for r in self.abort(list(abort_during_step))]
        engine_outputs = self.scheduler.update_from_output(sched_out, model_output)
        result = _summarise(sched_out, engine_outputs, kv_outputs, model_output, aborted)
        self.history.append(result)
        return result

    def _aggregate(
        self, kv_outputs: list[KVConnectorOutput | None], rank0: ModelRunnerOutput
    ) -> ModelRunnerOutput:
        # Each worker returns a ModelRunnerOutput; rank 0's carries the sampled tokens.
        if self.aggregator is None:
            return rank0
        outputs = [rank0] + [ModelRunnerOutput([], {}) for _ in kv_outputs[1:]]
        for out, kv in zip(outputs, kv_outputs, strict=False):
            out.kv_connector_output = kv
        merged = self.aggregator.aggregate(outputs, output_rank=0)
        assert merged is not None
        return merged

    def run_until(
        self, predicate: Callable[[EngineStepResult], bool], max_steps: int = 50
    ) -> list[EngineStepResult]:
        """Step until `predicate(result)`; else HarnessTimeout naming it and the state."""
        results: list[EngineStepResult] = []
        for _ in range(max_steps):
            results.append(self.step())
            if predicate(results[-1]):
                return results
        name = getattr(predicate, "__name__", repr(predicate))
        raise HarnessTimeout(
            f"predicate {name} still false after {max_steps} steps; {describe(self.scheduler)}"
        )

    def drain(self, max_steps: int = 50) -> list[EngineStepResult]:
        """Step until `has_requests()` is False, when EngineCore stops stepping."""
        return self.run_until(lambda _: not self.scheduler.has_requests(), max_steps)

    def finished(self) -> dict[str, FinishReason]:
        """Every request finished so far (from engine outputs), with its reason."""
        return {rid: why for r in self.history for rid, why in r.finished.items()}


def _summarise(
    sched_out: SchedulerOutput,
    engine_outputs: dict[int, EngineCoreOutputs],
    kv_outputs: list[KVConnectorOutput | None],
    model_output: ModelRunnerOutput,
    aborted: list[str],
) -> EngineStepResult:
    result = EngineStepResult(sched_out, engine_outputs, worker_outputs=kv_outputs, aborted=aborted)
    result.kv_connector_output = model_output.kv_connector_output
    for outputs in engine_outputs.values():
        for out in outputs.outputs:
            if out.new_token_ids:
                result.new_tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                result.finished[out.request_id] = out.finish_reason
                result.kv_transfer_params[out.request_id] = out.kv_transfer_params
    return result


def describe(scheduler: Scheduler) -> str:
    """A one-line account of the scheduler's requests and blocks, for failure messages."""
    states = {rid: (str(r.status), r.num_computed_tokens) for rid, r in scheduler.requests.items()}
    pool = scheduler.kv_cache_manager.block_pool
    return (
        f"requests={states} waiting={len(scheduler.waiting)} "
        f"kv_holding_waiting={len(scheduler.kv_holding_waiting)} "
        f"running={[r.request_id for r in scheduler.running]} "
        f"finished_req_ids={sorted(scheduler.finished_req_ids)} "
        f"free_blocks={pool.get_num_free_blocks()}/{pool.num_gpu_blocks - 1}"
    )


def assert_no_leak(scheduler: Scheduler) -> None:
    """The scheduler holds no requests and no blocks; call it after `Driver.drain()`.

    Right after the step that finishes the last request, `has_requests()` is still True:
    `scheduler.finished_req_ids` waits for the next SchedulerOutput, and EngineCore runs one
    more step to hand it to the workers. `drain()` runs that step.
    """
    held = {
        "requests": scheduler.requests,
        "running": scheduler.running,
        "waiting": list(scheduler.waiting),
        "kv_holding_waiting": list(scheduler.kv_holding_waiting),
        "deferred_waiting": scheduler.deferred_waiting,
        "inflight": scheduler._inflight_prefills,
        "finished_recving_kv_req_ids": scheduler.finished_recving_kv_req_ids,
        "failed_recving_kv_req_ids": scheduler.failed_recving_kv_req_ids,
        "deferred_frees": scheduler.deferred_frees,
        "finished_req_ids (not yet sent to workers)": scheduler.finished_req_ids,
    }
    left = {name: value for name, value in held.items() if value}
    assert not left, f"scheduler still holds {left}; {describe(scheduler)}"
    assert not scheduler.has_requests(), f"has_requests() is True: {describe(scheduler)}"
    _assert_blocks_free(scheduler)


def _assert_blocks_free(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    for single in manager.coordinator.single_type_managers:
        assert not single.req_to_blocks, f"req_to_blocks: {dict(single.req_to_blocks)}"
        assert not single.num_cached_block, f"num_cached_block: {single.num_cached_block}"
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, describe(scheduler)
    assert pool.get_usage() == 0.0, pool.get_usage()
    held = [b.block_id for b in pool.blocks if b.ref_cnt != 0 and not b.is_null]
    assert not held, f"blocks with ref_cnt != 0: {held}"
