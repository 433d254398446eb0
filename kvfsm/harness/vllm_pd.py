"""A two-engine vLLM harness: a prefill engine (P) and a decode engine (D) joined by a KV connector.

Each engine runs in its own ``spawn`` child process (``kvfsm.harness._vllm_proc``); this process
plays vLLM's toy proxy. Every prompt goes to P with ``max_tokens=1`` and
:data:`P_REQUEST_PARAMS` as its ``kv_transfer_params``; as soon as P's output for a request is
available, the request goes on to D with the ``kv_transfer_params`` P returned and the real
``max_tokens``, under the same request id (as the toy proxy's ``X-Request-Id``; push connectors
match D's registration to P's request by it). Per request the harness records D's tokens, the
hand-off latency (P's output available -> D's first token) and D's time to first token (D's
request submitted -> first token); per run, D's ``vllm:prompt_tokens_by_source`` counters, which
tell whether D loaded the prompt's KV or recomputed it.

Every wait is bounded. A timeout or an engine's death raises :class:`EngineError` naming the
engine and carrying the tail of its log; the children and the EngineCore processes under them are
killed in every case (each child leads its own process group). vLLM is imported only in the
children, never in this process::

    model = make_tiny_llama(tmp / "tiny")
    base = run_baseline(model, prompts)
    cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    env_p = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    env_d = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    res = run_pd(model, prompts, kv_transfer_config_p=cfg, kv_transfer_config_d=cfg,
                 env_p=env_p, env_d=env_d)
    assert res.token_ids == base and res.external_tokens > 0
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from types import TracebackType
from typing import Any

from kvfsm.harness._vllm_proc import (
    PROMPT_SOURCES,
    EngineError,
    EngineProcess,
    EngineSpec,
)

__all__ = [
    "PROMPT_SOURCES",
    "P_REQUEST_PARAMS",
    "EngineError",
    "EngineProcess",
    "EngineSpec",
    "PdPair",
    "PdRequestResult",
    "PdResult",
    "core_env",
    "make_prompts",
    "make_tiny_hybrid",
    "make_tiny_llama",
    "run_baseline",
    "run_pd",
]

#: The repository root (the folder holding ``kvfsm/`` and ``tests/``), put on children's path.

#: What vLLM's toy proxy sends to P as ``kv_transfer_params``, with ``max_tokens=1``.
P_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_START_TIMEOUT_S = 300.0


def make_prompts(n: int, seed: int, lo: int = 64, hi: int = 400) -> list[list[int]]:
    """``n`` prompts of random tokens, lengths uniform in ``[lo, hi]``."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 1024) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_tiny_llama(path: Path, seed: int = 0, *, sliding_window: int | None = None) -> Path:
    """A seeded random 2-layer Llama checkpoint (head_dim 64, no tokenizer) at ``path``.

    With ``sliding_window`` (tokens), layer 0 attends within that window and layer 1 to the
    whole prompt, as Gemma 3 or gpt-oss alternate: vLLM gives it a sliding-window and a
    full-attention KV cache group.

    Greedy output of this model depends on the KV contents, so a decode that did not receive the
    prefill's KV generates different tokens. Reused when ``path/config.json`` already exists
    (written last, so its presence means the checkpoint is complete).
    """
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        initializer_range=0.1,
        max_position_embeddings=512,
    )
    if sliding_window is not None:
        config.sliding_window = sliding_window
        config.layer_types = ["sliding_attention", "full_attention"]
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(config), path)  # type: ignore[no-untyped-call]


def make_tiny_hybrid(path: Path, seed: int = 0) -> Path:
    """A seeded random 4-layer Granite 4.0-H style checkpoint at ``path``: Mamba2 layers 0 and 2,
    attention layers 1 and 3 (vLLM gives it a Mamba and a full-attention KV cache group).

    vLLM 0.32 on CPU runs it in float32 only without prefix caching (its CPU chunk scan ignores
    the intermediate states prefix caching asks for). Reused like `make_tiny_llama`'s.
    """
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_local_experts=0,
        num_experts_per_tok=0,
        shared_intermediate_size=512,
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_head=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return _save(GraniteMoeHybridForCausalLM(config).float(), path)  # type: ignore[no-untyped-call]


def _save(model: Any, path: Path) -> Path:
    """Save `model` at `path`, config.json last (its presence means the checkpoint is whole)."""
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tiny-", dir=path.parent) as partial:
        model.save_pretrained(partial)
        files = sorted(Path(partial).iterdir(), key=lambda p: p.name == "config.json")
        for item in files:
            item.replace(path / item.name)
    return path


@dataclass(frozen=True)
class PdRequestResult:
    """One request through P and D. Times are ``time.time()`` values taken in the engines."""

    rid: str
    prompt_len: int
    token_ids: list[int]
    p_kv_transfer_params: dict[str, Any] | None = None
    p_done_t: float | None = None
    d_submit_t: float | None = None
    d_first_t: float | None = None
    error: str | None = None

    @property
    def handoff_s(self) -> float | None:
        """P's output available -> D's first token (the proxy hop, D's load and first step)."""
        if self.p_done_t is None or self.d_first_t is None:
            return None
        return self.d_first_t - self.p_done_t

    @property
    def d_ttft_s(self) -> float | None:
        """D's request submitted -> D's first token."""
        if self.d_submit_t is None or self.d_first_t is None:
            return None
        return self.d_first_t - self.d_submit_t


@dataclass(frozen=True)
class PdResult:
    """A P/D run: per-request results (in prompt order) and the engines' prompt-token counters."""

    requests: list[PdRequestResult]
    d_prompt_tokens_by_source: dict[str, float] = field(default_factory=dict)
    p_prompt_tokens_by_source: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    startup_s: dict[str, float] = field(default_factory=dict)
    log_dir: str = ""

    @property
    def token_ids(self) -> list[list[int]]:
        """D's generated tokens, one list per prompt."""
        return [r.token_ids for r in self.requests]

    @property
    def errors(self) -> list[str]:
        """``"<rid>: <error>"`` for every request that failed."""
        return [f"{r.rid}: {r.error}" for r in self.requests if r.error]

    @property
    def external_tokens(self) -> float:
        """Prompt tokens D took from the KV transfer (``external_kv_transfer``)."""
        return self.d_prompt_tokens_by_source.get("external_kv_transfer", 0.0)


def _log_dir(log_dir: Path | None) -> Path:
    """``log_dir`` (created), or a fresh temporary folder kept for inspection."""
    if log_dir is None:
        return Path(tempfile.mkdtemp(prefix="kvfsm-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir


def _spec(
    name: str,
    model_dir: Path,
    log_dir: Path,
    kv_config: Mapping[str, Any] | None,
    env: Mapping[str, str] | None,
    role: str,
) -> EngineSpec:
    """An :class:`EngineSpec` with the harness's defaults and its log file in ``log_dir``."""
    return EngineSpec(
        name=name,
        model_dir=str(model_dir),
        log_path=str(log_dir / f"{name}.log"),
        role=role,
        kv_transfer_config=None if kv_config is None else dict(kv_config),
        env=dict(env or {}),
    )


def core_env(index: int) -> dict[str, str]:
    """Pin an engine's worker to CPU ``index`` (modulo the CPU count).

    vLLM's default ("auto") binds every engine's worker to core 0 and keeps the last core for
    the front ends, so P's and D's forward passes (and the threads they start, NIXL's included)
    would share one core. In `run_pd`, ``VLLM_CPU_OMP_THREADS_BIND`` in ``env_p`` / ``env_d``
    overrides it.
    """
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[index % len(cpus)])}


def _start_all(specs: Sequence[EngineSpec], timeout_s: float) -> list[EngineProcess]:
    """Start every engine at once and wait until all are ready; on failure none is left."""
    procs: list[EngineProcess] = []
    try:
        for spec in specs:
            procs.append(EngineProcess(spec))
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.wait_ready(deadline)
    except BaseException:
        for proc in procs:
            proc.close()
        raise
    return procs


def _submit(rid: str, prompt: Sequence[int], max_tokens: int, params: Any) -> dict[str, Any]:
    """A ``submit`` message for an engine child."""
    return {
        "op": "submit",
        "rid": rid,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "kv_transfer_params": params,
    }


class PdPair:
    """A running P engine and D engine; a context manager that always cleans both up.

    Use it directly to run several batches on the same engines (a warm-up batch, then a measured
    one); :func:`run_pd` is the one-batch shorthand.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        kv_transfer_config_p: Mapping[str, Any],
        kv_transfer_config_d: Mapping[str, Any],
        env_p: Mapping[str, str] | None = None,
        env_d: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        start_timeout_s: float = _START_TIMEOUT_S,
    ) -> None:
        """Start P and D concurrently and wait until both engines are ready."""
        self.log_dir = _log_dir(log_dir)
        env_p = {**core_env(0), **(env_p or {})}
        env_d = {**core_env(1), **(env_d or {})}
        specs = [
            _spec("P", Path(model_dir), self.log_dir, kv_transfer_config_p, env_p, "prefill"),
            _spec("D", Path(model_dir), self.log_dir, kv_transfer_config_d, env_d, "decode"),
        ]
        self.p, self.d = _start_all(specs, start_timeout_s)

    def __enter__(self) -> PdPair:
        """The pair itself."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop both engines (see :meth:`close`)."""
        self.close()

    def close(self) -> None:
        """Stop both engines and kill their process groups."""
        for proc in (self.d, self.p):
            proc.close()

    def run_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int = 8,
        timeout_s: float = 300.0,
        rid_prefix: str = "req",
    ) -> list[PdRequestResult]:
        """Send every prompt to P at once, each to D as soon as P is done with it; wait for all."""
        rids = [f"{rid_prefix}-{i}" for i in range(len(prompts))]
        by_rid = dict(zip(rids, prompts, strict=True))
        for rid in rids:
            self.p.send(_submit(rid, by_rid[rid], 1, dict(P_REQUEST_PARAMS)))
        p_msgs: dict[str, dict[str, Any]] = {}
        d_msgs: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(p_msgs) < len(rids) or len(d_msgs) < len(p_msgs):
            for engine, msg in self._next_messages(deadline, rids, p_msgs, d_msgs):
                if msg.get("op") != "done":
                    raise engine.fail(f"unexpected message {msg.get('op')!r} during a batch")
                if engine is self.d:
                    d_msgs[msg["rid"]] = msg
                    continue
                p_msgs[msg["rid"]] = msg
                if msg["error"] is None and msg["kv_transfer_params"] is not None:
                    params = msg["kv_transfer_params"]
                    self.d.send(_submit(msg["rid"], by_rid[msg["rid"]], max_tokens, params))
                else:  # nothing goes to D; an empty D entry closes the request
                    d_msgs[msg["rid"]] = {}
        return [_result(rid, len(by_rid[rid]), p_msgs[rid], d_msgs[rid]) for rid in rids]

    def _next_messages(
        self,
        deadline: float,
        rids: Sequence[str],
        p_msgs: Mapping[str, Any],
        d_msgs: Mapping[str, Any],
    ) -> list[tuple[EngineProcess, dict[str, Any]]]:
        """The messages readable now from P and D, waiting until ``deadline`` for one."""
        engines = (self.p, self.d)
        ready = wait(
            [e.conn for e in engines] + [e.proc.sentinel for e in engines],
            timeout=max(deadline - time.monotonic(), 0.0),
        )
        out = [(e, e.read()) for e in engines if e.conn in ready]
        for engine in engines:
            if not out and engine.proc.sentinel in ready:
                engine.proc.join(timeout=5)
                raise engine.fail("the process ended during a batch")
        if not ready:
            waiting_p = [r for r in rids if r not in p_msgs]
            waiting_d = [r for r in p_msgs if r not in d_msgs]
            engine = self.p if waiting_p else self.d
            raise engine.fail(
                f"timed out: {len(waiting_p)} requests wait for P's output {waiting_p[:8]}, "
                f"{len(waiting_d)} for D's tokens {waiting_d[:8]}"
            )
        return out

    def counters(self, timeout_s: float = 60.0) -> tuple[dict[str, float], dict[str, float]]:
        """``(P's, D's)`` cumulative ``vllm:prompt_tokens_by_source`` counters."""
        deadline = time.monotonic() + timeout_s
        return self.p.counters(deadline), self.d.counters(deadline)


def _result(
    rid: str, prompt_len: int, p_msg: Mapping[str, Any], d_msg: Mapping[str, Any]
) -> PdRequestResult:
    """Merge P's and D's reports on one request."""
    error = p_msg.get("error") and f"P: {p_msg['error']}"
    if not error and p_msg.get("kv_transfer_params") is None:
        error = "P: its output carried no kv_transfer_params"
    if not error and d_msg.get("error"):
        error = f"D: {d_msg['error']}"
    if not error and d_msg.get("t_first") is None:
        error = "D: no token generated"
    return PdRequestResult(
        rid=rid,
        prompt_len=prompt_len,
        token_ids=list(d_msg.get("token_ids", [])),
        p_kv_transfer_params=p_msg.get("kv_transfer_params"),
        p_done_t=p_msg.get("t_done"),
        d_submit_t=d_msg.get("t_submit"),
        d_first_t=d_msg.get("t_first"),
        error=error or None,
    )


def run_pd(
    model_dir: Path,
    prompts: Sequence[Sequence[int]],
    *,
    kv_transfer_config_p: Mapping[str, Any],
    kv_transfer_config_d: Mapping[str, Any],
    env_p: Mapping[str, str] | None = None,
    env_d: Mapping[str, str] | None = None,
    max_tokens: int = 8,
    timeout_s: float = 480.0,
    log_dir: Path | None = None,
) -> PdResult:
    """Start P and D, run one batch of ``prompts`` through them, read D's counters, stop both.

    ``timeout_s`` bounds the whole run, start-up included; ``env_p`` / ``env_d`` go into each
    engine's environment (e.g. ``VLLM_NIXL_SIDE_CHANNEL_PORT``). Per-request failures are in
    :attr:`PdResult.errors`; an engine that dies or stalls raises :class:`EngineError`.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    with PdPair(
        model_dir,
        kv_transfer_config_p=kv_transfer_config_p,
        kv_transfer_config_d=kv_transfer_config_d,
        env_p=env_p,
        env_d=env_d,
        log_dir=log_dir,
        start_timeout_s=timeout_s,
    ) as pair:
        left = deadline - time.monotonic()
        requests = pair.run_batch(prompts, max_tokens=max_tokens, timeout_s=left)
        p_counters, d_counters = pair.counters(max(deadline - time.monotonic(), 30.0))
        startup = {"P": pair.p.startup_s or 0.0, "D": pair.d.startup_s or 0.0}
    return PdResult(
        requests=requests,
        d_prompt_tokens_by_source=d_counters,
        p_prompt_tokens_by_source=p_counters,
        wall_s=time.monotonic() - t0,
        startup_s=startup,
        log_dir=str(pair.log_dir),
    )


def run_baseline(
    model_dir: Path,
    prompts: Sequence[Sequence[int]],
    max_tokens: int = 8,
    *,
    timeout_s: float = 300.0,
    log_dir: Path | None = None,
) -> list[list[int]]:
    """Greedy tokens of one engine with no connector: what D must reproduce, one list per prompt."""
    spec = _spec("baseline", Path(model_dir), _log_dir(log_dir), None, None, "single")
    (engine,) = _start_all([spec], timeout_s)
    try:
        deadline = time.monotonic() + timeout_s
        rids = [f"base-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(rids, prompts, strict=True):
            engine.send(_submit(rid, prompt, max_tokens, None))
        done: dict[str, dict[str, Any]] = {}
        while len(done) < len(rids):
            msg = engine.wait_for(deadline, f"generating ({len(done)}/{len(rids)} done)")
            if msg.get("op") != "done" or msg.get("error"):
                raise engine.fail(f"baseline request failed: {msg}")
            done[msg["rid"]] = msg
    finally:
        engine.close()
    return [list(done[rid]["token_ids"]) for rid in rids]
