"""The README's recipe over HTTP: `vllm serve` P and D with kvfsm's connector (run from the
project's `.venv`, where the `vllm` command works), the project's proxy in front, an HTTP client;
a seeded tiny Llama (its greedy output depends on the KV contents) and prompts shorter than,
equal to and longer than a 32-token block multiple. `make test-slow`: in `make test` the
sliding-window Llama (test_serve_sliding_window.py) runs the same recipe, and the two-P two-D
test (test_serve_xpyd.py) this model, for the suite's time.

D's tokens through the proxy must equal P's own greedy tokens, D must count every prompt token
as received over the connector, and a D that claims loads it never made must be caught. The
engines share a secret (`KVFSM_SHARED_SECRET`) and serve 64 concurrent requests, none lost to the
replay guard."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfsm.harness.vllm_pd import make_tiny_llama
from kvfsm.serving.serve import Served, ServeError
from tests.vllm_connector.fixtures.serving import (
    Deployment,
    assert_a_skipping_d_is_caught,
    assert_concurrent_prompts_move_their_kv,
    assert_d_serves_p_tokens,
    served_in_both_modes,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

PROMPTS = [[(7 * i + j) % 1000 + 1 for j in range(n)] for i, n in enumerate((20, 32, 33, 64, 100))]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "llama")


served = served_in_both_modes(secret="llama-tests-shared-secret-value")
CONCURRENT = 64
LOAD = [[(13 * i + 3 * j) % 1000 + 1 for j in range(40 + 5 * i)] for i in range(CONCURRENT)]


def test_d_serves_p_tokens(served: Deployment) -> None:
    assert_d_serves_p_tokens(served, PROMPTS)


def _refused(engine: Served) -> float:
    try:
        return engine.metric("vllm:kvfsm_refused_notifications_total")
    except ServeError:  # never incremented: not exported
        return 0.0


def test_64_concurrent_requests_with_the_secret_all_move_their_kv(served: Deployment) -> None:
    assert_concurrent_prompts_move_their_kv(served, LOAD)
    (p,), (d,) = served.prefill, served.decode
    assert _refused(p) == _refused(d) == 0


def test_a_d_that_moves_nothing_is_caught(model: Path, tmp_path: Path) -> None:
    assert_a_skipping_d_is_caught(model, tmp_path, PROMPTS)
