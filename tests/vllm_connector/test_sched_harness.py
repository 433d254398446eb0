"""The scheduler harness drives a real vLLM Scheduler: plain decode, an async remote load, a
failed load under both failure policies, two workers, aborts (mid-load, mid-step) and a
delay-free send, each ending with nothing leaked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.vllm_connector.fixtures import fake_connector
from tests.vllm_connector.fixtures.fake_connector import FakeConnector
from tests.vllm_connector.fixtures.sched_harness import (
    SAMPLED_TOKEN_ID,
    Driver,
    EngineStepResult,
    HarnessTimeout,
    WorkerStub,
    assert_no_leak,
    make_request,
    make_scheduler,
    make_vllm_config,
    make_worker_connector,
    tiny_model_dir,
)

pytestmark = pytest.mark.vllm

PROMPT = list(range(100, 170))  # 70 tokens: two full blocks of 32 and a partial one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's config.json, shared by the module's tests."""
    return tiny_model_dir(tmp_path_factory)


def _fake_setup(
    model_dir: Path,
    *,
    policy: Literal["fail", "recompute"] = "fail",
    workers: int = 1,
    **extra: Any,
) -> tuple[Scheduler, Driver, list[FakeConnector]]:
    kv_config = {
        "kv_connector": "FakeConnector",
        "kv_connector_module_path": fake_connector.__name__,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    config = make_vllm_config(model_dir, kv_config, kv_load_failure_policy=policy)
    scheduler = make_scheduler(config, 64)
    connectors = [make_worker_connector(scheduler) for _ in range(workers)]
    fakes = [c for c in connectors if isinstance(c, FakeConnector)]
    assert len(fakes) == workers and isinstance(scheduler.connector, FakeConnector)
    driver = Driver(scheduler, [WorkerStub(c) for c in fakes])
    return scheduler, driver, fakes


def _finished(req_id: str) -> Callable[[EngineStepResult], bool]:
    def finished(result: EngineStepResult) -> bool:
        return req_id in result.finished

    finished.__name__ = f"{req_id}_finished"
    return finished


def test_plain_scheduler_runs_a_request_to_completion(model_dir: Path) -> None:
    scheduler = make_scheduler(make_vllm_config(model_dir, None))
    assert scheduler.connector is None
    driver = Driver(scheduler)
    driver.add(make_request("r1", PROMPT, max_tokens=3))
    results = driver.drain()
    tokens = [t for r in results for t in r.new_tokens.get("r1", [])]
    assert tokens == [SAMPLED_TOKEN_ID] * 3
    assert driver.finished() == {"r1": FinishReason.LENGTH}
    assert results[0].scheduler_output is not None
    assert results[0].scheduler_output.num_scheduled_tokens == {"r1": len(PROMPT)}
    assert_no_leak(scheduler)
    assert driver.step().idle  # EngineCore does not step an empty scheduler


def test_remote_prefill_waits_then_decodes(model_dir: Path) -> None:
    scheduler, driver, (worker,) = _fake_setup(model_dir)
    request = make_request(
        "d1", PROMPT, max_tokens=2, kv_transfer_params={"do_remote_prefill": True}
    )
    driver.add(request)
    statuses, calls = [], []
    while "d1" not in driver.finished():
        sched_out = driver.step().scheduler_output
        assert sched_out is not None
        statuses.append((sched_out.num_scheduled_tokens.get("d1", 0), str(request.status)))
        calls.append(worker.calls[:])
        worker.calls.clear()
    assert statuses[:2] == [(0, "WAITING_FOR_REMOTE_KVS")] * 2  # seen, then reported
    reported = driver.history[1].kv_connector_output
    assert reported is not None and reported.finished_recving == {"d1"}
    assert statuses[2] == (1, "RUNNING")  # only the last prompt token is recomputed
    assert driver.finished() == {"d1": FinishReason.LENGTH}
    tail = ["wait_for_save", "get_finished", "get_block_ids_with_load_errors"]
    no_forward = ["handle_preemptions", "bind_connector_metadata", "start_load_kv", *tail]
    layers = ["wait_for_layer_load", "save_kv_layer"] * 2
    forward = ["handle_preemptions", "bind_connector_metadata", *layers, "start_load_kv", *tail]
    assert calls[0] == [*no_forward, "clear_connector_metadata"]
    assert calls[2] == [*forward, "clear_connector_metadata"]
    assert isinstance(scheduler.connector, FakeConnector)
    sched_calls = scheduler.connector.calls
    assert sched_calls[:3] == [
        "get_num_new_matched_tokens",
        "update_state_after_alloc:70",
        "build_connector_meta",
    ]
    assert "update_state_after_alloc:0" in sched_calls  # the second call, after the load
    assert driver.drain()[-1].scheduler_output is not None  # a last step tells the workers
    assert_no_leak(scheduler)


def test_failed_load_is_recomputed_under_recompute(model_dir: Path) -> None:
    scheduler, driver, _ = _fake_setup(model_dir, policy="recompute", fail_block_index=1)
    request = make_request(
        "d1", PROMPT, max_tokens=2, kv_transfer_params={"do_remote_prefill": True}
    )
    driver.add(request)
    driver.step()
    assert request.num_computed_tokens == len(PROMPT)
    failed = driver.step()
    assert failed.kv_connector_output is not None
    assert failed.kv_connector_output.invalid_block_ids
    assert request.num_computed_tokens == 32  # cut back to the block before the failed one
    recompute = driver.step()
    assert recompute.scheduler_output is not None
    assert recompute.scheduler_output.num_scheduled_tokens == {"d1": len(PROMPT) - 32}
    driver.drain()
    assert driver.finished() == {"d1": FinishReason.LENGTH}
    assert_no_leak(scheduler)


def test_failed_load_errors_the_request_under_fail(model_dir: Path) -> None:
    scheduler, driver, _ = _fake_setup(model_dir, policy="fail", fail_block_index=0)
    driver.add(
        make_request("d1", PROMPT, max_tokens=2, kv_transfer_params={"do_remote_prefill": True})
    )
    results = driver.drain()
    assert driver.finished() == {"d1": FinishReason.ERROR}
    assert results[1].finished == {"d1": FinishReason.ERROR}  # the step that reported the load
    assert not any(r.new_tokens for r in results)
    assert_no_leak(scheduler)


def test_a_load_finishes_only_when_every_worker_reports_it(model_dir: Path) -> None:
    scheduler, driver, (_, slow) = _fake_setup(model_dir, workers=2)
    slow.recv_delay_steps = 3
    request = make_request(
        "d1", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_prefill": True}
    )
    driver.add(request)
    for _ in range(4):
        driver.step()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert driver.history[1].worker_outputs[0] is not None  # fast reported at step 2 ...
    assert driver.history[1].worker_outputs[0].finished_recving == {"d1"}
    assert driver.history[3].kv_connector_output is not None  # ... the aggregate at step 4
    assert driver.history[3].kv_connector_output.finished_recving == {"d1"}
    driver.drain()
    assert driver.finished() == {"d1": FinishReason.LENGTH}
    assert_no_leak(scheduler)


def test_abort_during_a_load_holds_blocks_until_the_load_ends(model_dir: Path) -> None:
    scheduler, driver, _ = _fake_setup(model_dir)
    driver.add(
        make_request("d1", PROMPT, max_tokens=2, kv_transfer_params={"do_remote_prefill": True})
    )
    driver.step()
    assert [r.request_id for r in driver.abort("d1")] == ["d1"]
    assert "d1" in scheduler.requests  # delay-freed: the workers may still write its blocks
    assert scheduler.kv_cache_manager.block_pool.get_usage() > 0
    driver.drain()
    assert_no_leak(scheduler)


def test_abort_during_a_step_drops_its_output(model_dir: Path) -> None:
    scheduler, driver, _ = _fake_setup(model_dir)
    driver.add(make_request("r1", PROMPT, max_tokens=5))
    assert driver.step().new_tokens == {"r1": [SAMPLED_TOKEN_ID]}
    aborted = driver.step(abort_during_step=["r1"])
    assert aborted.aborted == ["r1"] and not aborted.new_tokens
    assert "r1" in aborted.scheduler_output.num_scheduled_tokens  # type: ignore[union-attr]
    driver.drain()
    assert_no_leak(scheduler)


def test_delay_free_send_holds_blocks_until_sent(model_dir: Path) -> None:
    scheduler, driver, _ = _fake_setup(model_dir)
    driver.add(
        make_request("p1", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    first = driver.step()
    assert first.finished == {"p1": FinishReason.LENGTH}
    params = first.kv_transfer_params["p1"]
    assert params is not None and len(params["remote_block_ids"]) == 3
    assert "p1" in scheduler.requests
    results = driver.drain()
    assert results[-1].kv_connector_output is not None
    assert results[-1].kv_connector_output.finished_sending == {"p1"}
    assert_no_leak(scheduler)


def test_run_until_says_what_is_stuck(model_dir: Path) -> None:
    _, driver, _ = _fake_setup(model_dir, recv_delay_steps=100)
    driver.add(
        make_request("d1", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_prefill": True})
    )
    with pytest.raises(
        HarnessTimeout, match=r"d1_finished still false after 3 steps.*WAITING_FOR_REMOTE_KVS"
    ):
        driver.run_until(_finished("d1"), max_steps=3)
