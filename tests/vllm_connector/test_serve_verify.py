"""Integrity through `vllm serve` (`verify = "all"`): a P whose connector flips a byte of every
transfer's KV after taking its checksum (`CorruptingKvfsmConnector`, the negative control).
D's check catches every load: each fails with its blocks invalid, is counted in
`vllm:kvfsm_corrupted`, and with `kv_load_failure_policy = "recompute"` D computes the prompt
itself, so the client still gets P's own tokens and none of the corrupted KV. The positive
control (verify on, nothing corrupted, nothing flagged) runs in test_serve_sliding_window.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfsm.harness.vllm_pd import make_tiny_llama
from tests.vllm_connector.fixtures.serving import deployment, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

PROMPTS = [[(7 * i + 11 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate((40, 90))]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "llama")


def test_kv_corrupted_after_its_checksum_is_caught_and_recomputed(
    model: Path, tmp_path: Path
) -> None:
    p_connector = {
        "module": "kvfsm.vllm.negative_control",
        "connector": "CorruptingKvfsmConnector",
        "verify": "all",
    }
    d_connector = {"verify": "all", "kv_load_failure_policy": "recompute"}
    with deployment(model, "pull", tmp_path, p_connector=p_connector, d_connector=d_connector) as s:
        (p,), (d,) = s.prefill, s.decode
        expected = [tokens(p.address, x) for x in PROMPTS]  # P alone: nothing granted yet
        assert [tokens(s.address, x) for x in PROMPTS] == expected
        assert d.metric("vllm:kvfsm_corrupted_total") == len(PROMPTS)
        counts = d.prompt_tokens_by_source()
        assert counts.get("local_compute", 0) >= sum(len(x) for x in PROMPTS), counts
        assert counts.get("external_kv_transfer", 0) == 0, counts
