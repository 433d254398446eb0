"""A sliding-window model served disaggregated: a tiny Llama whose layer 0 attends within 64
tokens and layer 1 to everything, so vLLM keeps two KV cache groups and frees the sliding
group's blocks that fall out of the window. Prompts reach 200 tokens (7 blocks of 32), so P
moves the full group's every block and the sliding group's last 3.

D's tokens through the proxy must equal P's own greedy tokens, and D must count every prompt
token as received over the connector. The engines share a secret (`KVFSM_SHARED_SECRET`), as a
deployment beyond one host should, check every transfer's bytes (`verify = "all"`: the positive
control of test_serve_verify.py; none is flagged), and serve 64 concurrent prompts of 40 to 355
tokens: every length the window meets, each one's KV moved (a fixed count of window blocks failed
D's loads where vLLM gave D fewer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfsm.harness.vllm_pd import make_tiny_llama
from kvfsm.serving.serve import ServeError
from tests.vllm_connector.fixtures.serving import (
    Deployment,
    assert_a_skipping_d_is_caught,
    assert_concurrent_prompts_move_their_kv,
    assert_d_serves_p_tokens,
    served_in_both_modes,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

PROMPTS = [
    [(11 * i + 5 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate((20, 64, 150, 200))
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "sw", sliding_window=64)


served = served_in_both_modes(secret="sliding-window-tests-shared-secret", extra={"verify": "all"})


def test_d_serves_p_tokens(served: Deployment) -> None:
    assert_d_serves_p_tokens(served, PROMPTS)


def test_64_concurrent_prompts_of_every_length_all_move_their_kv(served: Deployment) -> None:
    load = [[(13 * i + 3 * j) % 1000 + 1 for j in range(40 + 5 * i)] for i in range(64)]
    assert_concurrent_prompts_move_their_kv(served, load)
    (d,) = served.decode
    assert d.metric("vllm:kvfsm_verified_total") >= len(load)  # every transfer checked
    with pytest.raises(ServeError):  # never incremented: nothing was corrupted
        d.metric("vllm:kvfsm_corrupted_total")


@pytest.mark.slow  # make test-slow: make test's negative control is test_serve_verify.py's
def test_a_d_that_moves_nothing_is_caught(model: Path, tmp_path: Path) -> None:
    assert_a_skipping_d_is_caught(model, tmp_path, PROMPTS)
