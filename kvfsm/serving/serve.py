"""`vllm serve` engines for the tests and benchmarks, started as the README starts them.

`Served` runs one `vllm serve` (the `vllm` command beside this interpreter) on this CPU
machine's flags (float32, eager, no tokenizer, 32-token blocks) with a KV connector config;
`complete` is an OpenAI completions client; `prompt_tokens_by_source` reads the counters D
keeps of where each prompt token's KV came from. Standard library only; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CPU_FLAGS", "ServeError", "Served", "complete", "kvfsm_transfer_config"]

CPU_FLAGS = (
    "--dtype",
    "float32",
    "--block-size",
    "32",
    "--enforce-eager",
    "--skip-tokenizer-init",
    "--max-model-len",
    "512",
    "--served-model-name",
    "tiny",
)
"""What vLLM on a CPU machine needs for the tiny test models (docs/vllm.md, "Running it")."""

_COUNTER = re.compile(r'vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)')


class ServeError(RuntimeError):
    """An engine exited or did not come up; the message carries the tail of its log."""


def kvfsm_transfer_config(
    role: str, mode: str, side_channel_port: int | None, **extra: Any
) -> dict[str, Any]:
    """kvfsm's `--kv-transfer-config` for `role` ("kv_producer"/"kv_consumer") and `mode`;
    `extra` goes to `kv_connector_extra_config`, but `connector`, `module` and
    `kv_load_failure_policy`, which are vLLM's. `side_channel_port` None: none in the config
    (the engine takes `$VLLM_NIXL_SIDE_CHANNEL_PORT`, as vLLM's NixlConnector does)."""
    policy = extra.pop("kv_load_failure_policy", "fail")
    port = {} if side_channel_port is None else {"side_channel_port": side_channel_port}
    return {
        "kv_connector": extra.pop("connector", "KvfsmConnector"),
        "kv_connector_module_path": extra.pop("module", "kvfsm.vllm"),
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"mode": mode, **port, **extra},
    }


class Served:
    """One `vllm serve` process on `port`; its output goes to `log`."""

    def __init__(
        self,
        model: Path,
        port: int,
        log: Path,
        kv_transfer_config: Mapping[str, Any] | None = None,
        *,
        flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port, self.log = port, log
        vllm = Path(sys.executable).with_name("vllm")
        command = [str(vllm), "serve", str(model), "--port", str(port), *CPU_FLAGS, *flags]
        if kv_transfer_config is not None:
            command += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        full_env.update(env or {})
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                # A process group of its own (killed whole), but not a session of its own: NIXL
                # notifications between two engines started each in a new session never arrived.
                command,
                stdout=out,
                stderr=out,
                env=full_env,
                process_group=0,
            )

    @property
    def address(self) -> str:
        """`host:port` of its HTTP server."""
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, until: float) -> None:
        """Return once `/health` answers; `ServeError` if it exits or `until` (monotonic) passes."""
        while True:
            if self.process.poll() is not None:
                raise ServeError(f"vllm serve exited {self.process.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=2):
                    return
            except OSError:
                if time.monotonic() > until:
                    raise ServeError(f"vllm serve did not come up: {self.tail()}") from None
                time.sleep(0.5)  # polling a process that offers no readiness event

    def tail(self, chars: int = 3000) -> str:
        """The end of its log."""
        return self.log.read_text(errors="replace")[-chars:]

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """`vllm:prompt_tokens_by_source` by source (`local_compute`, `external_kv_transfer`, ...)."""
        return {source: float(value) for source, value in _COUNTER.findall(self._metrics())}

    def metric(self, name: str) -> float:
        """The Prometheus metric `name` (e.g. `vllm:kv_cache_usage_perc`), summed over labels."""
        pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
        values = pattern.findall(self._metrics())
        if not values:
            raise ServeError(f"{self.address} exports no metric {name}")
        return sum(float(v) for v in values)

    def _metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=30) as answer:
            return str(answer.read().decode())

    def kill(self) -> None:
        """SIGKILL the server and its engine processes (a crashed engine)."""
        self._signal(9)

    def close(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 30 s)."""
        self._signal(15)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self._signal(9)
        self.process.wait()

    def _signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, number)


def complete(address: str, prompt: list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A greedy `/v1/completions` of token ids at `address`, with `return_token_ids`."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body.update(return_token_ids=True, **extra)
    request = urllib.request.Request(
        f"http://{address}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        result: dict[str, Any] = json.loads(answer.read())
    return result
