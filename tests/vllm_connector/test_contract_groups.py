"""The scheduler contract with two KV cache groups: a tiny Llama whose layer 0 attends within 64
tokens (a sliding-window group) and layer 1 to everything (a full-attention group), overlaid on
one KV tensor as vLLM's hybrid allocator lays them out (tests/vllm_connector/fixtures/pd_pair.py).

A 150-token prompt fills 5 blocks per group; vLLM frees the sliding group's first 2 as the
window passes them, and kvfsm moves the full group's 5 and the sliding group's last 3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.v1.engine import FinishReason

from tests.vllm_connector.fixtures.pd_pair import Engine, Pair, pair
from tests.vllm_connector.fixtures.sched_harness import make_request, tiny_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

MODES = ["push", "pull"]
PROMPT = list(range(200, 350))  # 150 tokens: 5 blocks of 32
WINDOW_BLOCKS = 3  # ceil(64 / 32) + 1: what a sliding-window group keeps for the next token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory, sliding_window=64)


def _moved(blocks: list[list[int]]) -> list[int]:
    sliding, full = blocks
    return sliding[-WINDOW_BLOCKS:] + full


def _kv(engine: Engine, blocks: list[int]) -> torch.Tensor:
    """The blocks' KV with every rank's heads side by side (heads are dim 1)."""
    return torch.cat([_overlaid(kv)[blocks] for _, kv in engine.ranks], dim=1)


def _overlaid(kv: dict[str, torch.Tensor]) -> torch.Tensor:
    (tensor,) = {t.data_ptr(): t for t in kv.values()}.values()  # one tensor for both groups
    return tensor


def _hand_off(e: Pair, prompt: list[int] = PROMPT) -> tuple[list[int], list[int]]:
    """P prefills, D loads: (P's moved blocks, D's), read while both still hold them."""
    params = e.prefill("p-1", prompt)
    p_blocks = _moved(e.p.group_blocks("p-1"))
    assert params["remote_block_ids"] == p_blocks
    assert params["kvfsm_group_blocks"] == [WINDOW_BLOCKS, 5]
    e.decode("d-1", params, prompt)
    e.settle(
        lambda: "d-1" in e.d.scheduler.requests and bool(e.d.group_blocks("d-1")[1]), "D allocating"
    )
    d_blocks = _moved(e.d.group_blocks("d-1"))
    return p_blocks, d_blocks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tp", [(1, 1), (1, 2)], ids=["P1-D1", "P1-D2"])
def test_every_group_moves_and_d_runs(model_dir: Path, mode: str, tp: tuple[int, int]) -> None:
    with pair(model_dir, mode, tp=tp) as e:
        p_blocks, d_blocks = _hand_off(e)
        e.settle(lambda: "d-1" in e.d.driver.finished(), "D finishing d-1")
        assert len(p_blocks) == len(d_blocks) == WINDOW_BLOCKS + 5
        assert torch.equal(_kv(e.p, p_blocks), _kv(e.d, d_blocks))
        e.assert_idle()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_fails_the_request_in_every_group(
    model_dir: Path, mode: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Block ids name nothing without their group: vLLM takes the request's id (failed_recving)
    # and drops or recomputes all of it; a block id here would stop vLLM's engine.
    monkeypatch.setenv("UCX_TCP_USER_TIMEOUT", "1s")  # as in test_contract
    with pair(model_dir, mode, policy, lease_s=0.2, heartbeat_s=0.1) as e:
        params = e.prefill("p-1", PROMPT)
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P's lease expiring")
        e.decode("d-1", params, PROMPT)
        e.settle(lambda: "d-1" in e.d.driver.finished(), "D ending d-1")
        failed = [r.kv_connector_output for r in e.d.driver.history if r.kv_connector_output]
        assert any("d-1" in kv.failed_recving and "d-1" in kv.finished_recving for kv in failed)
        assert not any(kv.invalid_block_ids for kv in failed)
        expected = FinishReason.LENGTH if policy == "recompute" else FinishReason.ERROR
        assert e.d.driver.finished()["d-1"] == expected
        e.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_a_local_prefix_hit_on_d_computes_the_rest_and_lets_p_go(
    model_dir: Path, mode: str
) -> None:
    with pair(model_dir, mode) as e:
        e.d.driver.add(make_request("local", PROMPT, max_tokens=1))  # caches PROMPT's blocks
        e.settle(lambda: "local" in e.d.driver.finished(), "the local request")
        params = e.prefill("p-1", PROMPT)
        e.decode("d-1", params, PROMPT)
        e.settle(lambda: "d-1" in e.d.driver.finished(), "D finishing d-1")
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P letting go")
        assert e.d.connector._sched is not None
        assert e.d.connector._sched.counters["local_hit_computed"] == 1
        e.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_d_aborted_mid_load_frees_every_group_on_both(model_dir: Path, mode: str) -> None:
    with pair(model_dir, mode) as e:
        params = e.prefill("p-1", PROMPT)
        e.decode("d-1", params, PROMPT)
        e.d.driver.step()
        e.d.driver.abort("d-1")
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P letting go")
        e.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_blocks_that_do_not_pair_group_by_group_fail_the_load_and_free_p(
    model_dir: Path, mode: str
) -> None:
    # The transfer pairs the concatenated groups from their end: if D held fewer blocks of one
    # group than P moves, the other groups' blocks would shift. D refuses such a load.
    with pair(model_dir, mode, "recompute") as e:
        params = e.prefill("p-1", PROMPT)
        e.decode("d-1", params | {"kvfsm_group_blocks": [WINDOW_BLOCKS - 1, 5]}, PROMPT)
        e.settle(lambda: "d-1" in e.d.driver.finished(), "D recomputing d-1")
        e.settle(lambda: "p-1" not in e.p.scheduler.requests, "P letting go")
        outputs = [r.kv_connector_output for r in e.d.driver.history if r.kv_connector_output]
        assert any("d-1" in kv.failed_recving for kv in outputs)
        assert e.d.driver.finished()["d-1"] == FinishReason.LENGTH
        assert e.d.connector._sched is not None
        assert e.d.connector._sched.counters["group_mismatch"] == 1
        e.assert_idle()
