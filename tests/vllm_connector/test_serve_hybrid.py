"""A hybrid SSM model served disaggregated: a tiny Granite 4.0-H style model, Mamba2 layers beside
attention layers, so vLLM keeps a Mamba group (one state page per request) and a full-attention
group on the same pages. P prefills all but the prompt's last token; D receives the attention
blocks and the Mamba state after N-1 tokens and computes the last token itself (vLLM's
convention for Mamba).

D's tokens through the proxy must equal P's own greedy tokens, and D must count every prompt
token but the last as received over the connector."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfsm.harness.vllm_pd import make_tiny_hybrid
from tests.vllm_connector.fixtures.serving import (
    Deployment,
    assert_a_skipping_d_is_caught,
    assert_d_serves_p_tokens,
    served_in_both_modes,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

PROMPTS = [[(13 * i + 7 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate((20, 64, 150))]
# vLLM 0.32's CPU Mamba2 kernels fail with prefix caching (see make_tiny_hybrid).
FLAGS = ("--no-enable-prefix-caching",)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hybrid(tmp_path_factory.mktemp("model") / "hybrid")


served = served_in_both_modes(FLAGS)


def test_d_serves_p_tokens(served: Deployment) -> None:
    assert_d_serves_p_tokens(served, PROMPTS, backoff=1)


@pytest.mark.slow  # make test-slow, as the other models' skipping-D controls
def test_a_d_that_moves_nothing_is_caught(model: Path, tmp_path: Path) -> None:
    assert_a_skipping_d_is_caught(model, tmp_path, PROMPTS, FLAGS)
