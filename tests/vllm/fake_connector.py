"""A trivial KV connector for the scheduler harness's own tests (tests/vllm/sched_harness.py).

Scheduler side: a request whose `kv_transfer_params` has `do_remote_prefill` gets its whole
uncomputed prompt as an asynchronous external hit, once; a request with `do_remote_decode` is
held after it finishes (delay-free) until the workers report it sent. Worker side: a load is
reported in `finished_recving` `recv_delay_steps` steps after the worker first sees it in the
metadata (1: the next step); a send is reported the step after. With `fail_block_index` in the
extra config, the block at that index of every load is reported in
`get_block_ids_with_load_errors()` in the same step as the request's `finished_recving`.

Each instance records its calls in `calls`, so tests can check the order the harness uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class FakeMetadata(KVConnectorMetadata):
    """Scheduler -> worker: loads to start (request id -> block ids) and sends to finish."""

    def __init__(self, loads: dict[str, list[int]], sends: set[str]) -> None:
        """Hold this step's new loads and sends."""
        self.loads = loads
        self.sends = sends


class FakeConnector(KVConnectorBase_V1, SupportsHMA):
    """Both roles of the trivial connector; see the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        """Read `recv_delay_steps` and `fail_block_index` from the extra config."""
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.recv_delay_steps: int = int(extra.get("recv_delay_steps", 1))
        self.fail_block_index: int | None = extra.get("fail_block_index")
        self.calls: list[str] = []
        # Scheduler side.
        self._new_loads: dict[str, list[int]] = {}
        self._new_sends: set[str] = set()
        # Worker side.
        self._recv_countdown: dict[str, int] = {}
        self._recv_blocks: dict[str, list[int]] = {}
        self._send_countdown: dict[str, int] = {}
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The uncomputed prompt, asynchronously, for a remote-prefill request."""
        self.calls.append("get_num_new_matched_tokens")
        params = request.kv_transfer_params or {}
        n = len(request.prompt_token_ids or ()) - num_computed_tokens
        if params.get("do_remote_prefill") and n > 0:
            return n, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan a load into the request's blocks; a request is loaded once (as NIXL does)."""
        self.calls.append(f"update_state_after_alloc:{num_external_tokens}")
        if num_external_tokens > 0:
            self._new_loads[request.request_id] = list(blocks.get_block_ids()[0])
            assert request.kv_transfer_params is not None
            request.kv_transfer_params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Hand this step's new loads and sends to the workers."""
        self.calls.append("build_connector_meta")
        meta = FakeMetadata(self._new_loads, self._new_sends)
        self._new_loads, self._new_sends = {}, set()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Single-group form; vLLM calls `request_finished_all_groups` on SupportsHMA."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hold a remote-decode request's blocks until the workers report it sent."""
        self.calls.append("request_finished_all_groups")
        if not (request.kv_transfer_params or {}).get("do_remote_decode"):
            return False, None
        self._new_sends.add(request.request_id)
        return True, {"do_remote_prefill": True, "remote_block_ids": list(block_ids[0])}

    # ------------------------------------------------------------ worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Record the call, then bind."""
        self.calls.append("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Record the call, then clear."""
        self.calls.append("clear_connector_metadata")
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Nothing to do; recorded."""
        self.calls.append("handle_preemptions")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start the countdowns for the loads and sends in this step's metadata."""
        self.calls.append("start_load_kv")
        meta = self._get_connector_metadata()
        assert isinstance(meta, FakeMetadata)
        for req_id, blocks in meta.loads.items():
            self._recv_countdown[req_id] = self.recv_delay_steps
            self._recv_blocks[req_id] = blocks
        for req_id in meta.sends:
            self._send_countdown[req_id] = 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for; recorded."""
        self.calls.append("wait_for_layer_load")

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing to save; recorded."""
        self.calls.append("save_kv_layer")

    def wait_for_save(self) -> None:
        """Nothing to wait for; recorded."""
        self.calls.append("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report the loads and sends whose countdown ran out; note failed blocks."""
        self.calls.append("get_finished")
        recving = _tick(self._recv_countdown)
        for req_id in recving:
            blocks = self._recv_blocks.pop(req_id)
            if self.fail_block_index is not None:
                self._load_errors.add(blocks[self.fail_block_index])
        return _tick(self._send_countdown) or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The failed blocks of the loads reported finished in this step."""
        self.calls.append("get_block_ids_with_load_errors")
        errors, self._load_errors = self._load_errors, set()
        return errors


def _tick(countdown: dict[str, int]) -> set[str]:
    # Report ids at zero, count the others down.
    done = {req_id for req_id, left in countdown.items() if left <= 0}
    for req_id in countdown:
        countdown[req_id] -= 1
    for req_id in done:
        del countdown[req_id]
    return done
