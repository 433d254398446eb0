"""The README's recipe over HTTP: `vllm serve` P and D with kvfsm's connector (run from the
project's `.venv`, where the `vllm` command works), the project's proxy in front, an HTTP client.

D's tokens through the proxy must equal P's own greedy tokens for the same prompt (one engine,
no hand-off), and D's `vllm:prompt_tokens_by_source` must count every prompt token as received
over the connector: with no transfer D would recompute them, and still match."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfsm.harness.proxy import Proxy
from kvfsm.harness.vllm_pd import make_tiny_llama
from kvfsm.testing import free_port

_START_S = 300.0  # a bound on an engine's start, not a timing expectation
_PROMPTS = [[(7 * i + j) % 1000 + 1 for j in range(40 + 13 * i)] for i in range(4)]
_CPU_FLAGS = [  # what vLLM on this CPU machine needs (REFERENCE section 3); no tokenizer
    "--dtype", "float32", "--block-size", "32", "--enforce-eager", "--skip-tokenizer-init",
    "--max-model-len", "512",
]  # fmt: skip


class _Serve:
    """One `vllm serve` process with kvfsm's connector, as the README starts it."""

    def __init__(self, model: Path, role: str, mode: str, log: Path) -> None:
        self.port = free_port()
        config = {
            "kv_connector": "KvfsmConnector", "kv_connector_module_path": "kvfsm.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"mode": mode, "side_channel_port": free_port()},
        }  # fmt: skip
        vllm = Path(sys.executable).with_name("vllm")
        command = [str(vllm), "serve", str(model), "--port", str(self.port), *_CPU_FLAGS]
        command += ["--served-model-name", "tiny"]
        command += ["--kv-transfer-config", json.dumps(config)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=out, env=env)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, until: float) -> None:
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"vllm serve exited {self.process.returncode}: {self._tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=2):
                    return
            except OSError:
                if time.monotonic() > until:
                    pytest.fail(f"vllm serve not up in {_START_S} s: {self._tail()}")
                time.sleep(0.5)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=30) as answer:
            return str(answer.read().decode())

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _complete(address: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    body.update(return_token_ids=True, **extra)
    request = urllib.request.Request(
        f"http://{address}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as answer:
        result: dict[str, Any] = json.loads(answer.read())
    return result


@pytest.fixture(scope="module", params=["push", "pull"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[_Serve, _Serve, Proxy]]:
    mode = request.param
    model = make_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")
    logs = tmp_path_factory.mktemp(f"serve-{mode}")
    p = _Serve(model, "kv_producer", mode, logs / "p.log")
    d = _Serve(model, "kv_consumer", mode, logs / "d.log")
    proxy = None
    try:
        until = time.monotonic() + _START_S
        p.wait_ready(until)
        d.wait_ready(until)
        proxy = Proxy(free_port(), [p.address], [d.address]).start()
        yield p, d, proxy
    finally:
        if proxy is not None:
            proxy.close()
        d.close()
        p.close()


def test_d_serves_p_tokens_through_the_proxy(served: tuple[_Serve, _Serve, Proxy]) -> None:
    p, d, proxy = served
    for prompt in _PROMPTS:
        alone = _complete(p.address, prompt)["choices"][0]["token_ids"]
        through = _complete(f"127.0.0.1:{proxy.port}", prompt)
        assert through["choices"][0]["token_ids"] == alone
        assert len(alone) == 8
    received = re.search(
        r'vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)',
        d.metrics(),
    )
    assert received is not None
    assert float(received.group(1)) == sum(len(x) for x in _PROMPTS)  # as tests/vllm/test_e2e
