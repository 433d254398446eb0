"""xPyD: two P and two D `vllm serve` engines (kvfsm, pull) behind the project's proxy.

Requests spread over every engine, and each D loads from whichever P prefilled its request (all
four pairings). Then one P is killed while it holds finished prefills: the D that receives one
cannot reach that P, fails the load and, with `kv_load_failure_policy=recompute`, computes the
prompt itself, serving the same tokens. The proxy passes over the dead P, and the engines that
survived hold no request and no KV block at the end.

The engines are set up as a NixlConnector deployment is: each one's side channel comes from
`VLLM_NIXL_SIDE_CHANNEL_HOST` and `_PORT` in its environment, none from kvfsm's settings, so
four engines on one host do not collide (the drop-in path, docs/vllm.md)."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvfsm.harness.vllm_pd import make_tiny_llama
from kvfsm.serving.serve import Served, complete
from tests.vllm_connector.fixtures.serving import Deployment, deployment, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

PROMPTS = [[(17 * i + 3 * j) % 1000 + 1 for j in range(24 + 19 * i)] for i in range(8)]
# D gives up on an unreachable P after 2 s instead of 10, and recomputes what it could not load.
D_CONNECTOR = {"handshake_timeout_s": 2.0, "kv_load_failure_policy": "recompute"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "llama")


def _prefill(p: Served, prompt: list[int]) -> dict[str, Any]:
    """What the proxy does first: P prefills and answers with the params for D."""
    answer = complete(p.address, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params: dict[str, Any] = answer["kv_transfer_params"]
    return params


def _decode(d: Served, prompt: list[int], params: dict[str, Any]) -> list[int]:
    ids: list[int] = complete(d.address, prompt, kv_transfer_params=params)["choices"][0][
        "token_ids"
    ]
    return ids


def _assert_idle(engine: Served) -> None:
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert engine.metric(gauge) == 0, (engine.address, gauge)
    assert engine.metric("vllm:kv_cache_usage_perc") == 0, engine.address


def test_two_p_two_d_serve_and_a_killed_p_fails_over_to_recompute(
    model: Path, tmp_path: Path
) -> None:
    with deployment(
        model, "pull", tmp_path, prefill=2, decode=2, d_connector=D_CONNECTOR, nixl_env=True
    ) as s:
        (p0, p1), (d0, d1) = s.prefill, s.decode
        expected = [tokens(p0.address, x) for x in PROMPTS]  # one engine, no hand-off
        pairings = itertools.product(s.prefill, s.decode)
        for (p, d), x, want in zip(pairings, PROMPTS[:4], expected[:4], strict=True):
            assert _decode(d, x, _prefill(p, x)) == want  # every pairing
        with ThreadPoolExecutor(4) as pool:  # the proxy spreads concurrent requests
            assert list(pool.map(lambda x: tokens(s.address, x), PROMPTS)) == expected
        _assert_loaded_everywhere(s)

        held = [_prefill(p0, x) for x in PROMPTS[:4]]  # P0 holds these prefills' blocks
        p0.kill()
        computed = d0.prompt_tokens_by_source().get("local_compute", 0.0)
        for x, params, want, d in zip(
            PROMPTS[:4], held, expected[:4], (d0, d1, d0, d1), strict=True
        ):
            assert _decode(d, x, params) == want
        assert d0.prompt_tokens_by_source()["local_compute"] - computed >= len(PROMPTS[0])
        assert tokens(s.address, PROMPTS[5]) == expected[5]  # P1 serves on, P0 passed over
        for engine in (p1, d0, d1):
            _assert_idle(engine)


def _assert_loaded_everywhere(s: Deployment) -> None:
    for d in s.decode:
        assert d.prompt_tokens_by_source().get("external_kv_transfer", 0) > 0, d.address
