"""P and D `vllm serve` engines with kvfsm's connector behind the project's proxy, for the
end-to-end tests (`kvfsm.serving.serve` starts each engine as the README does)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfsm.serving.proxy import Proxy
from kvfsm.serving.serve import Served, ServeError, complete, kvfsm_transfer_config
from kvfsm.testing import free_port

START_S = 300.0  # a bound on an engine's start, not a timing expectation
SKIPPING = {"connector": "SkippingKvfsmConnector", "module": "kvfsm.vllm.negative_control"}
"""D's connector for the negative control: it claims every load without moving a byte."""


@dataclass
class Deployment:
    """Prefill and decode engines, and the proxy in front of them."""

    prefill: list[Served]
    decode: list[Served]
    proxy: Proxy

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.proxy.port}"


@contextmanager
def deployment(
    model: Path,
    mode: str,
    logs: Path,
    *,
    prefill: int = 1,
    decode: int = 1,
    d_connector: dict[str, Any] | None = None,
    flags: Sequence[str] = (),
    secret: str = "",
    nixl_env: bool = False,
) -> Iterator[Deployment]:
    """`prefill` P and `decode` D engines serving `model` in `mode` (`vllm serve` with `flags`
    too), and a proxy; all stopped at the end. `d_connector` overrides D's connector
    (`connector`, `module` keys). `secret`: the deployment's shared secret, set as
    `KVFSM_SHARED_SECRET` in every engine's environment (none if empty). `nixl_env`: each
    engine's side channel as a NixlConnector deployment gives it, `VLLM_NIXL_SIDE_CHANNEL_HOST`
    and `_PORT` in its environment, none in its transfer config."""
    env = {"KVFSM_SHARED_SECRET": secret} if secret else {}
    with ExitStack() as stack:
        engines: dict[str, list[Served]] = {"p": [], "d": []}
        for side, count, role in (("p", prefill, "kv_producer"), ("d", decode, "kv_consumer")):
            for i in range(count):
                extra = (d_connector or {}) if side == "d" else {}
                side_channel, own_env = free_port(), dict(env)
                if nixl_env:
                    own_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
                    own_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel)
                port = None if nixl_env else side_channel
                config = kvfsm_transfer_config(role, mode, port, **extra)
                log = logs / f"{side}{i}.log"
                served = Served(model, free_port(), log, config, flags=flags, env=own_env)
                stack.callback(served.close)
                engines[side].append(served)
        until = time.monotonic() + START_S
        try:
            for served in engines["p"] + engines["d"]:
                served.wait_ready(until)
        except ServeError as exc:
            pytest.fail(str(exc))
        proxy = Proxy(
            free_port(), [s.address for s in engines["p"]], [s.address for s in engines["d"]]
        ).start()
        stack.callback(proxy.close)
        yield Deployment(engines["p"], engines["d"], proxy)


def tokens(address: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    """The greedy completion's token ids."""
    ids: list[int] = complete(address, prompt, max_tokens)["choices"][0]["token_ids"]
    return ids


def served_in_both_modes(flags: Sequence[str] = (), secret: str = "") -> Any:
    """A module fixture `served`: a deployment of the module's `model` fixture, push then pull
    (with the shared `secret`, if not empty)."""

    @pytest.fixture(scope="module", params=["push", "pull"])
    def served(
        request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[Deployment]:
        logs = tmp_path_factory.mktemp(request.param)
        with deployment(model, request.param, logs, flags=flags, secret=secret) as d:
            yield d

    return served


def assert_a_skipping_d_is_caught(
    model: Path, logs: Path, prompts: Sequence[list[int]], flags: Sequence[str] = ()
) -> None:
    """Negative control: a D that reports every load done without moving a byte succeeds (that
    is the danger) but serves other tokens for some prompt, so `assert_d_serves_p_tokens`
    depends on the transfer."""
    with deployment(model, "pull", logs, d_connector=SKIPPING, flags=flags) as served:
        p = served.prefill[0]
        assert [len(x) for x in prompts if tokens(served.address, x) != tokens(p.address, x)]


def assert_d_serves_p_tokens(
    served: Deployment, prompts: Sequence[list[int]], backoff: int = 0
) -> None:
    """Through the proxy, D serves P's own greedy tokens for every prompt (one engine, no
    hand-off), and D counts every prompt token but the last `backoff` as received over the
    connector: with no transfer D would recompute them, and still match."""
    (p,), (d,) = served.prefill, served.decode
    for prompt in prompts:
        assert tokens(served.address, prompt) == tokens(p.address, prompt), len(prompt)
    counts = d.prompt_tokens_by_source()
    assert counts.get("external_kv_transfer") == sum(len(x) - backoff for x in prompts), counts


def assert_concurrent_prompts_move_their_kv(
    served: Deployment, prompts: Sequence[list[int]]
) -> None:
    """All `prompts` at once through the proxy: D serves P's own tokens for each, and D counts
    every prompt token as received over the connector (none recomputed)."""
    (p,), (d,) = served.prefill, served.decode
    with ThreadPoolExecutor(len(prompts)) as pool:
        expected = list(pool.map(lambda x: tokens(p.address, x), prompts))
        before = d.prompt_tokens_by_source().get("external_kv_transfer", 0.0)
        got = list(pool.map(lambda x: tokens(served.address, x), prompts))
    assert got == expected
    received = d.prompt_tokens_by_source()["external_kv_transfer"] - before
    assert received == sum(len(x) for x in prompts)
