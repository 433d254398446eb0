"""The connector's contract with vLLM's scheduler, for push and pull: a real vLLM `Scheduler` per
engine with `KvfsmConnector`'s scheduler half, and its worker half in-process over real NIXL
agents and ZMQ on loopback; only the model is fake (one sampled token per step, no forward).

Every test ends with both schedulers holding no request and no block, and both connectors
holding no request state."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvfsm.core import Consumer, Producer, Side
from kvfsm.testing import free_port
from kvfsm.vllm import KvfsmConnector, KvfsmStats, SettingsError
from tests.vllm_connector.fixtures.pd_pair import PROMPT, Engine, pair
from tests.vllm_connector.fixtures.sched_harness import (
    make_request,
    make_scheduler,
    make_vllm_config,
    tiny_model_dir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

MODES = ["push", "pull"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


def _stats(engine: Engine) -> KvfsmStats:
    """Every stats window vLLM collected from the engine's workers, aggregated as vLLM does."""
    total = KvfsmConnector.build_kv_connector_stats()
    for result in engine.driver.history:
        kv = result.kv_connector_output
        if kv is not None and kv.kv_connector_stats is not None:
            total = total.aggregate(kv.kv_connector_stats)
    return total


def _heads(engine: Engine, blocks: list[int]) -> dict[str, torch.Tensor]:
    """Each layer's KV of `blocks` with every rank's heads side by side (heads are dim 1)."""
    return {n: torch.cat([kv[n][blocks] for _, kv in engine.ranks], dim=1) for n in engine.kv}


def _same_kv(p: Engine, p_blocks: list[int], d: Engine, d_blocks: list[int]) -> bool:
    return all(torch.equal(p.kv[n][p_blocks], d.kv[n][d_blocks]) for n in p.kv)


@pytest.mark.parametrize("mode", MODES)
def test_p_holds_blocks_until_sent_and_d_waits_then_runs(model_dir: Path, mode: str) -> None:
    with pair(model_dir, mode) as e:
        params = e.prefill("p-1")
        assert params["transfer_mode"] == mode and params["remote_block_ids"] == e.p.blocks("p-1")
        p_blocks = params["remote_block_ids"]
        assert e.p.scheduler.requests["p-1"].is_finished()  # finished, blocks held: delay_free
        e.decode("d-1", params)
        e.d.driver.step()
        assert e.d.scheduler.requests["d-1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        d_blocks = e.d.blocks("d-1")
        e.settle(lambda: "d-1" in e.d.driver.finished(), "D finishing")
        assert e.d.driver.finished()["d-1"] == FinishReason.LENGTH
        assert _same_kv(e.p, p_blocks, e.d, d_blocks)
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P freeing its blocks")
        e.assert_idle()
        # A request's end reaches the stats window on the worker's loop thread: the window
        # vLLM collects at the step after the blocks went back may be the first to hold it.
        counted = lambda: _stats(e.p).reduce()["done"] == _stats(e.d).reduce()["done"] == 1  # noqa: E731
        e.settle(counted, "both stats windows counting the request done")
        p_stats, d_stats = _stats(e.p).reduce(), _stats(e.d).reduce()
        moved = len(p_blocks) * sum(t[0].numel() * t.element_size() for t in e.p.kv.values())
        poster = p_stats if mode == "push" else d_stats  # who posted the transfer
        assert poster["transfers"] == 1 and poster["bytes"] == moved
        assert any(k.startswith("avg_ms_") for k in d_stats)  # time in state
        for engine in (e.p, e.d):  # every step of both lifecycles was checked at run time
            worker = engine.ranks[0][0]._worker
            assert worker is not None and worker.engine is not None
            checked = worker.engine.conformance
            assert checked is not None and checked.steps >= 4 and checked.divergences == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tp", [(1, 2), (2, 1)], ids=["P1-D2", "P2-D1"])
def test_tp_sizes_differ_each_rank_gets_its_heads(
    model_dir: Path, mode: str, tp: tuple[int, int]
) -> None:
    # The tiny model's 2 KV heads: one per rank on the TP-2 side. vLLM reports the load (or the
    # send) only once every rank did.
    with pair(model_dir, mode, tp=tp) as e:
        params = e.prefill("p-1")
        assert params["tp_size"] == tp[0]
        e.decode("d-1", params)
        e.d.driver.step()
        d_blocks = e.d.blocks("d-1")
        e.settle(lambda: "d-1" in e.d.driver.finished(), "D finishing")
        p_kv, d_kv = _heads(e.p, params["remote_block_ids"]), _heads(e.d, d_blocks)
        assert all(torch.equal(p_kv[n], d_kv[n]) for n in p_kv)
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P freeing its blocks")
        e.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_d_aborted_before_scheduling_releases_p_at_once(model_dir: Path, mode: str) -> None:
    with pair(model_dir, mode) as e:
        params = e.prefill("p-1")
        e.decode("d-1", params)
        e.d.driver.abort("d-1")  # never scheduled: D tells P to let go (P's lease is 60 s)
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P freeing its blocks")
        e.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_d_aborted_during_the_transfer_releases_both(model_dir: Path, mode: str) -> None:
    with pair(model_dir, mode) as e:
        params = e.prefill("p-1")
        e.decode("d-1", params)
        e.d.driver.step(abort_during_step=["d-1"])  # its Admit reached the worker this step
        assert e.d.scheduler.requests["d-1"].is_finished()  # blocks held until the load ends
        e.settle(lambda: "d-1" not in e.d.scheduler.requests, "D freeing the aborted load")
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P freeing its blocks")
        e.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_p_aborted_before_its_prefill_finishes(model_dir: Path, mode: str) -> None:
    with pair(model_dir, mode) as e:
        params = {"do_remote_decode": True}
        e.p.driver.add(make_request("p-1", PROMPT, max_tokens=1, kv_transfer_params=params))
        step = e.p.driver.step(abort_during_step=["p-1"])  # arrives while the prefill runs
        assert step.aborted == ["p-1"] and "p-1" not in e.p.scheduler.requests  # freed at once
        assert not step.kv_transfer_params.get("p-1")  # no params: no D can come for it
        e.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_d_prefix_cache_hit_loads_only_the_rest(model_dir: Path, mode: str) -> None:
    with pair(model_dir, mode) as e:
        e.d.driver.add(make_request("local", PROMPT, max_tokens=1))  # caches PROMPT's full blocks
        e.settle(lambda: "local" in e.d.driver.finished(), "the local request")
        params = e.prefill("p-1")
        e.decode("d-1", params)
        e.d.driver.step()
        d_blocks = e.d.blocks("d-1")
        e.settle(lambda: "d-1" in e.d.driver.finished(), "D finishing")
        assert _same_kv(e.p, params["remote_block_ids"][-1:], e.d, d_blocks[-1:])
        assert not _same_kv(e.p, params["remote_block_ids"][:1], e.d, d_blocks[:1])
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P freeing its blocks")
        e.assert_idle()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_is_reported_as_invalid_blocks(
    model_dir: Path, mode: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # D holds a given-up load's blocks for UCX's TCP timeout plus 2 s: 3 s here, not 12.
    monkeypatch.setenv("UCX_TCP_USER_TIMEOUT", "1s")
    # P's lease runs out before D comes: D's load must fail, never read reused blocks.
    with pair(model_dir, mode, policy, lease_s=0.2, heartbeat_s=0.1) as e:
        params = e.prefill("p-1")
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P's lease expiring")
        e.decode("d-1", params)
        steps: list[tuple[set[int], set[str]]] = []  # per D step: invalid blocks, loads ended

        def recorded() -> list[tuple[set[int], set[str]]]:
            kv = e.d.driver.history[-1].kv_connector_output
            if kv is not None:
                steps.append((set(kv.invalid_block_ids or ()), set(kv.finished_recving or ())))
            return steps

        e.d.driver.step()
        d_blocks = e.d.blocks("d-1")
        e.settle(lambda: bool(recorded()) and "d-1" in e.d.driver.finished(), "D failing it")
        # With the "fail" policy vLLM ends the request on the invalid blocks, and frees them
        # only at finished_recving: once no byte can land (push: P was told where to write).
        handed_back = lambda: any("d-1" in r for _, r in recorded())  # noqa: E731
        e.settle(handed_back, "D handing the blocks back")
        ended = next(i for i, (_, recving) in enumerate(steps) if "d-1" in recving)
        # Every block of the load is reported invalid no later than the step that ends it.
        assert set(d_blocks) <= set().union(*(invalid for invalid, _ in steps[: ended + 1]))
        expected = FinishReason.LENGTH if policy == "recompute" else FinishReason.ERROR
        assert e.d.driver.finished()["d-1"] == expected
        e.assert_idle()
        assert _stats(e.p).reduce()["expired"] == 1
        assert _stats(e.d).reduce()["failed"] == 1
        assert not _stats(e.d).is_empty()


@pytest.mark.parametrize(
    ("mode", "cls", "command"),
    [
        ("push", Producer, "_req_cmd_post_transfer"),
        ("pull", Consumer, "_req_cmd_send_registration"),
    ],
    ids=["bug_on_P_push", "bug_on_D_pull"],
)
def test_a_bug_fails_the_load_safely_and_vllm_gets_every_block_back(
    model_dir: Path,
    mode: str,
    cls: type[Side],
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A command that raises on one side: the request is given up there (D's blocks reported
    invalid, recomputed), the bug is logged on `vllm.kvfsm` and counted in the stats, every
    block goes back to both schedulers once the hold ends, and the next request is served."""
    monkeypatch.setenv("UCX_TCP_USER_TIMEOUT", "1s")  # the drain bound: 3 s, not 12

    def planted(self: Side, req: object) -> None:
        raise RuntimeError("planted bug")

    monkeypatch.setattr(cls, command, planted)
    bounds: dict[str, Any] = {
        "stall_s": 0.5,
        "producer_stall_s": 1.0,
        "watchdog_s": 1.0,
        "fence_s": 1.0,
    }
    with (
        caplog.at_level(logging.ERROR, logger="vllm.kvfsm"),
        pair(model_dir, mode, "recompute", d_extra=bounds, **bounds) as e,
    ):
        params = e.prefill("p-1")
        e.decode("d-1", params)
        e.settle(lambda: "d-1" in e.d.driver.finished(), "D finishing d-1 (recomputed)")
        assert e.d.driver.finished()["d-1"] == FinishReason.LENGTH
        e.settle(lambda: not e.p.scheduler.requests, "P handing its blocks back")
        e.settle(lambda: not e.d.scheduler.requests, "D handing its blocks back")
        e.assert_idle()
        buggy = e.p if cls is Producer else e.d
        assert _stats(buggy).reduce()["internal_errors"] == 1
        assert any("planted bug" in r.getMessage() for r in caplog.records)
        monkeypatch.undo()  # the engines go on: the next request is served from P's KV
        params = e.prefill("p-2")
        e.decode("d-2", params)
        e.settle(lambda: "d-2" in e.d.driver.finished(), "D finishing d-2")
        e.settle(lambda: not e.p.scheduler.requests, "P releasing p-2")
        e.assert_idle()


def test_prometheus_metrics_count_what_the_stats_carry(model_dir: Path) -> None:
    registry = CollectorRegistry()
    types: dict[type, Any] = {
        t: functools.partial(t, registry=registry) for t in (Counter, Gauge, Histogram)
    }
    config = make_vllm_config(
        model_dir,
        {
            "kv_connector": "KvfsmConnector",
            "kv_connector_module_path": "kvfsm.vllm",
            "kv_role": "kv_consumer",
        },
    )
    prom = KvfsmConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})
    window = {
        "ended": {"done": 2, "failed": 1},
        "counts": {"transfers": 3, "bytes": 4096},
        "seconds": {"reading": 0.5},
        "visits": {"reading": 3},
    }
    prom.observe(window, engine_idx=0)
    prom.observe(window, engine_idx=0)
    value = registry.get_sample_value
    assert value("vllm:kvfsm_requests_total", {"engine": "0", "state": "done"}) == 4
    assert value("vllm:kvfsm_requests_total", {"engine": "0", "state": "failed"}) == 2
    assert value("vllm:kvfsm_bytes_total", {"engine": "0"}) == 8192
    assert value("vllm:kvfsm_seconds_in_state_total", {"engine": "0", "state": "reading"}) == 1.0
    gauges = ("vllm:kvfsm_draining", "vllm:kvfsm_drained")
    assert [value(g, {"engine": "0"}) for g in gauges] == [0, 0]  # serving
    prom.observe({"engines": {"draining": 1}}, engine_idx=0)
    assert [value(g, {"engine": "0"}) for g in gauges] == [1, 0]
    prom.observe({"engines": {"drained": 1}, "counts": {"goodbyes": 1}}, engine_idx=0)
    assert [value(g, {"engine": "0"}) for g in gauges] == [1, 1]
    assert value("vllm:kvfsm_goodbyes_total", {"engine": "0"}) == 1


@pytest.mark.parametrize("mode", MODES)
def test_an_unreachable_p_fails_the_load_in_bounded_time(model_dir: Path, mode: str) -> None:
    with pair(model_dir, mode, d_extra={"handshake_timeout_s": 0.5}) as e:
        params = e.prefill("p-1")
        e.decode("d-1", params | {"remote_port": free_port()})  # nothing listens there
        e.d.driver.step()
        d_blocks = e.d.blocks("d-1")
        invalid: set[int] = set()

        def failed() -> bool:
            kv = e.d.driver.history[-1].kv_connector_output
            invalid.update(kv.invalid_block_ids or () if kv is not None else ())
            return "d-1" in e.d.driver.finished()

        e.settle(failed, "D failing the load")
        assert set(d_blocks) <= invalid
        assert e.d.driver.finished()["d-1"] == FinishReason.ERROR
        e.d.assert_idle()  # P's blocks wait for its lease: it never heard from this D


@pytest.mark.parametrize(
    "bad",
    [
        {"remote_host": None},
        {"remote_port": "5600"},
        {"tp_size": 0},
        {"transfer_mode": "other"},
        {"kvfsm_group_blocks": [-1]},
        {"kvfsm_group_blocks": [1] * 257},
    ],
)
def test_malformed_params_from_a_client_make_d_compute_locally(
    model_dir: Path, bad: dict[str, Any]
) -> None:
    with pair(model_dir, "pull") as e:
        params = e.prefill("p-1")
        e.decode("d-1", params | bad)
        e.settle(lambda: "d-1" in e.d.driver.finished(), "D finishing")
        assert e.d.driver.finished()["d-1"] == FinishReason.LENGTH  # computed, not loaded
        sched = e.d.connector._sched
        assert sched is not None and sched.counters["bad_params"] == 1
        e.d.assert_idle()


@pytest.mark.parametrize(
    ("role", "extra", "match"),
    [
        ("kv_both", {}, "kv_role 'kv_both'"),
        ("kv_consumer", {"mode": "sideways"}, "mode"),
        ("kv_consumer", {"leese_s": 3}, "leese_s"),
    ],
)
def test_what_kvfsm_cannot_run_is_refused_at_start_up(
    model_dir: Path, role: str, extra: dict[str, Any], match: str
) -> None:
    config = {
        "kv_connector": "KvfsmConnector",
        "kv_connector_module_path": "kvfsm.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }
    with pytest.raises(SettingsError, match=match):
        make_scheduler(make_vllm_config(model_dir, config), 64)
