"""A P and a D vLLM engine in-process for the scheduler-contract tests: a real vLLM `Scheduler`
per engine with `KvfsmConnector`'s scheduler half, and its worker half per rank over real NIXL
agents and ZMQ on loopback; only the model is fake (one sampled token per step, no forward)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from sched_harness import (
    Driver,
    EngineStepResult,
    WorkerStub,
    assert_no_leak,
    describe,
    make_cpu_kv_caches,
    make_request,
    make_scheduler,
    make_vllm_config,
    make_worker_connector,
)
from vllm.distributed import parallel_state

from kvfsm.testing import free_port
from kvfsm.vllm import KvfsmConnector

PROMPT = list(range(100, 170))  # 70 tokens: two full blocks of 32 and a partial third
BOUND_S = 30.0
# Only a protocol event ends a wait; every step is checked against its model as it runs.
FAST = {"lease_s": 60.0, "watchdog_s": 60.0, "fence_s": 60.0, "conformance": True}


class Engine:
    """One vLLM engine in-process: its scheduler (with the connector's scheduler half) and its
    worker ranks (the worker half each, real NIXL, the CPU KV tensors it registered)."""

    def __init__(
        self, model_dir: Path, role: str, extra: dict[str, Any], policy: str, tp: int = 1
    ) -> None:
        config = {
            "kv_connector": "KvfsmConnector",
            "kv_connector_module_path": "kvfsm.vllm",
            "kv_role": role,
            "kv_connector_extra_config": extra | {"side_channel_port": free_port()},
        }
        vllm_config = make_vllm_config(model_dir, config, kv_load_failure_policy=policy)  # type: ignore[arg-type]
        vllm_config.parallel_config.tensor_parallel_size = tp
        self.scheduler = make_scheduler(vllm_config, 64)
        self.ranks = [self._rank(r) for r in range(tp)]
        self.worker, self.kv = self.ranks[0]
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, KvfsmConnector)
        handshakes = {r: w.get_handshake_metadata() for r, (w, _) in enumerate(self.ranks)}
        self.connector.set_xfer_handshake_metadata(handshakes)
        self.driver = Driver(self.scheduler, [WorkerStub(w, kv) for w, kv in self.ranks])

    def _rank(self, rank: int) -> tuple[KvfsmConnector, dict[str, torch.Tensor]]:
        with pytest.MonkeyPatch.context() as mp:  # the rank vLLM's parallel state would give
            mp.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: rank)
            worker = make_worker_connector(self.scheduler)
        assert isinstance(worker, KvfsmConnector)
        kv = make_cpu_kv_caches(self.scheduler)
        worker.register_kv_caches(kv)
        return worker, kv

    def blocks(self, rid: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
        return list(ids)

    def group_blocks(self, rid: str) -> list[list[int]]:
        """The request's blocks, one list per KV cache group (0: vLLM's null block)."""
        return [list(ids) for ids in self.scheduler.kv_cache_manager.get_block_ids(rid)]

    def assert_idle(self) -> None:
        """No request left in the scheduler, its blocks, the connector or the cores."""
        self.driver.drain()
        assert_no_leak(self.scheduler)
        sched = self.connector._sched
        assert sched is not None and not sched._awaited and not sched._admitted
        for connector, _ in self.ranks:
            worker = connector._worker
            assert worker is not None and worker.loop is not None
            assert not worker._awaited
            live = worker.loop.call(lambda e: dict(e.side.requests)).result(BOUND_S)
            assert not live, f"the core still holds {live}"
            checked = worker.engine.conformance if worker.engine is not None else None
            assert checked is not None and not checked.violations, checked.violations

    def close(self) -> None:
        for worker, _ in self.ranks:
            worker.shutdown()
        self.connector.shutdown()


class Pair:
    """A P and a D engine stepped in turn, as their engine cores would, waiting (on an event)
    for the workers' reports when neither has work to do."""

    def __init__(
        self,
        model_dir: Path,
        mode: str,
        policy: str,
        p_extra: dict[str, Any],
        tp: tuple[int, int],
        d_extra: dict[str, Any],
    ) -> None:
        self.progress = threading.Event()
        p_settings = {"mode": mode, **FAST, **p_extra}
        d_settings = {"mode": mode, **FAST, **d_extra}
        self.p = Engine(model_dir, "kv_producer", p_settings, policy, tp[0])
        self.d = Engine(model_dir, "kv_consumer", d_settings, policy, tp[1])
        for engine in (self.p, self.d):
            for connector, _ in engine.ranks:
                assert connector._worker is not None
                connector._worker.on_report = self.progress.set
        torch.manual_seed(0)
        for _, kv in self.p.ranks:
            for tensor in kv.values():
                tensor.copy_(torch.rand_like(tensor))

    def settle(self, done: Callable[[], bool], what: str) -> None:
        """Step both engines until `done()`; fail saying `what` did not happen."""
        for _ in range(10_000):
            self.progress.clear()
            busy = [_did_work(e.driver.step()) for e in (self.p, self.d)]
            if done():
                return
            if not any(busy) and not self.progress.wait(BOUND_S):
                break
        pytest.fail(
            f"{what} did not happen; P: {describe(self.p.scheduler)};"
            f" D: {describe(self.d.scheduler)}"
        )

    def prefill(self, rid: str, prompt: list[int] = PROMPT) -> dict[str, Any]:
        """Run a prefill on P; its params for D."""
        self.p.driver.add(
            make_request(rid, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        )
        self.settle(lambda: rid in self.p.driver.finished(), f"P finishing {rid}")
        (params,) = [r.kv_transfer_params[rid] for r in self.p.driver.history if rid in r.finished]
        assert params is not None and params["remote_request_id"] == rid
        return dict(params)

    def decode(self, rid: str, params: dict[str, Any], prompt: list[int] = PROMPT) -> None:
        self.d.driver.add(make_request(rid, prompt, max_tokens=3, kv_transfer_params=params))

    def assert_idle(self) -> None:
        self.p.assert_idle()
        self.d.assert_idle()

    def close(self) -> None:
        self.d.close()
        self.p.close()


def _did_work(result: EngineStepResult) -> bool:
    out = result.scheduler_output
    kv = result.kv_connector_output
    moved = kv is not None and bool(
        kv.finished_sending or kv.finished_recving or kv.invalid_block_ids
    )
    return bool(out and out.total_num_scheduled_tokens) or bool(result.finished) or moved


@contextmanager
def pair(
    model_dir: Path,
    mode: str,
    policy: str = "fail",
    tp: tuple[int, int] = (1, 1),
    d_extra: dict[str, Any] | None = None,
    **p_extra: Any,
) -> Iterator[Pair]:
    engines = Pair(model_dir, mode, policy, p_extra, tp, d_extra or {})
    try:
        yield engines
    finally:
        engines.close()
