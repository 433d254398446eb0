"""vLLM's own NixlConnector through the in-process harness the hand-off benchmark uses
(`kvfsm.harness.vllm_pd`): the anchor should a kvfsm end-to-end test fail (is it the harness or
kvfsm?). kvfsm's own end-to-end tests run `vllm serve` behind the proxy (test_serve_*.py).

One seeded tiny Llama (its greedy output depends on the KV contents), five prompts around the
32-token block size (shorter than, equal to and longer than a block multiple), 8 tokens each. D's
tokens must equal one connector-less engine's, and D's ``vllm:prompt_tokens_by_source`` counters
must show the prompts' KV arrived through the connector.

vLLM runs only in child processes (``kvfsm.harness.vllm_pd``): this process never imports it.
Each pair takes about a minute on two cores; a slow first NIXL connection is tolerated, and
nothing here asserts a timing.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvfsm.harness.vllm_pd import PdResult, make_tiny_llama, run_baseline, run_pd
from kvfsm.testing import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

PROMPT_LENGTHS = (20, 32, 33, 64, 100)
MAX_TOKENS = 8
PROMPTS = [[random.Random(n).randrange(1, 1024) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded random tiny Llama checkpoint, built once for the module."""
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Greedy tokens of one engine without a connector: what every D must reproduce."""
    tokens = run_baseline(tiny_model, PROMPTS, MAX_TOKENS, log_dir=tmp_path_factory.mktemp("logs"))
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(PROMPTS)
    return tokens


def assert_served_from_transfer(res: PdResult, baseline: list[list[int]]) -> None:
    """D's tokens equal the baseline's and D took prompt KV from the transfer."""
    assert res.errors == [], res.errors
    for prompt, got, want in zip(PROMPTS, res.token_ids, baseline, strict=True):
        assert got == want, f"{len(prompt)}-token prompt: D served {got}, baseline {want}"
    counters = res.d_prompt_tokens_by_source
    assert res.external_tokens > 0, f"D recomputed instead of loading: {counters}"


@pytest.mark.slow  # `make test-slow`, and `make bench-vllm` checks it too
def test_nixl_pull_matches_baseline(
    tiny_model: Path, baseline: list[list[int]], tmp_path: Path
) -> None:
    """vLLM's own NixlConnector through the harness: the anchor for everything below, should a
    kvfsm test fail (is it the harness or kvfsm?). It tests vLLM, not kvfsm, so `make test`
    leaves it out."""
    cfg_p = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    cfg_d = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}

    def env() -> dict[str, str]:
        port = str(free_port())
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": port}

    res = run_pd(
        tiny_model,
        PROMPTS,
        kv_transfer_config_p=cfg_p,
        kv_transfer_config_d=cfg_d,
        env_p=env(),
        env_d=env(),
        max_tokens=MAX_TOKENS,
        log_dir=tmp_path,  # the engines' logs, kept with pytest's other temporary files
    )
    assert_served_from_transfer(res, baseline)
    # NixlConnector loads every prompt token: D computes none of the prompts.
    assert res.external_tokens == sum(PROMPT_LENGTHS), res.d_prompt_tokens_by_source
