"""The connector's scheduler half while the engine drains (docs/vllm.md, "Draining an
engine"): D claims no remote tokens and fails a load it had promised (vLLM recomputes), P hands
nothing over and answers `kvfsm_refused`, the workers get one `Drain`, and vLLM keeps stepping
until every rank reports drained."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvfsm.core import Admit, Drain
from kvfsm.sidechannel import ControlRequest
from kvfsm.vllm._scheduler import REFUSED_DRAINING, SchedulerSide
from kvfsm.vllm._settings import KvfsmSettings


def _side(producer: bool) -> SchedulerSide:
    settings = KvfsmSettings.from_extra_config({"mode": "push"})
    return SchedulerSide(settings, is_producer=producer, engine_id="e", tp_size=1, port=1)


def _d_request(rid: str) -> Any:
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_request_id": rid,
        "remote_block_ids": [1, 2],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "transfer_mode": "push",
    }
    return SimpleNamespace(
        request_id=rid, kv_transfer_params=params, prompt_token_ids=[1] * 40, num_computed_tokens=0
    )


def _blocks(*ids: int) -> Any:
    return SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [list(ids)])


def test_a_draining_d_claims_nothing_and_fails_a_promised_load() -> None:
    d = _side(producer=False)
    promised = _d_request("a")
    assert d.matched_tokens(promised, 0)[0] > 0  # before the drain
    assert d.control(ControlRequest("drain")) == "draining"  # a load is promised, not admitted
    fresh = _d_request("b")
    assert d.matched_tokens(fresh, 0) == (0, False)  # vLLM computes this prompt
    d.allocated(promised, _blocks(7, 8), 32)  # its blocks came after the drain
    step = d.take_step()
    assert [type(e) for e, _ in step.events] == [Drain]  # no Admit: the core refuses them
    assert [rid for rid, _ in step.refused] == ["a"]  # reported failed: vLLM recomputes
    assert d.pending and d.drain_state == "draining"
    d.reported(None, {"a"}, {"engines": {"draining": 1}})
    assert d.pending  # vLLM keeps stepping until the ranks drained
    d.reported(None, None, {"engines": {"drained": 1}})
    assert not d.pending and d.drain_state == "drained"


def test_a_draining_p_hands_nothing_over() -> None:
    p = _side(producer=True)
    params = {"do_remote_decode": True}
    request = SimpleNamespace(
        request_id="r",
        kv_transfer_params=params,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
        num_computed_tokens=32,
    )
    p.allocated(request, SimpleNamespace(get_block_ids=lambda: [[3, 4]]), 0)
    assert [type(e) for e, _ in p.take_step().events] == [Admit]
    p.control(ControlRequest("drain"))
    assert p.finished(request, [[3, 4]]) == (False, REFUSED_DRAINING)  # aborted, not handed
    late = SimpleNamespace(request_id="s", kv_transfer_params={"do_remote_decode": True})
    p.allocated(late, SimpleNamespace(get_block_ids=lambda: [[5]]), 0)  # not admitted
    assert p.finished(late, [[5]]) == (False, REFUSED_DRAINING)
    assert [type(e).__name__ for e, _ in p.take_step().events] == ["Abort", "Drain"]


def test_an_idle_engine_is_drained_at_once() -> None:
    d = _side(producer=False)
    assert d.control(ControlRequest("status")) == "serving"
    assert d.control(ControlRequest("drain")) == "drained"  # nothing live, no step to wait for
    assert d.control(ControlRequest("status")) == "drained"
