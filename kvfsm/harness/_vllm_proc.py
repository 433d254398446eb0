"""One vLLM engine in its own process: the child's side, and the parent's handle on it.

A parent (``kvfsm.harness.vllm_pd``) starts :func:`engine_main` in a ``spawn`` child with an
:class:`EngineSpec`. The child becomes a process-group leader (so the parent can kill the engine
and the EngineCore process vLLM forks under it in one call), points its stdout and stderr at a log
file, sets its environment and only then imports vLLM. It serves requests that arrive over a
:class:`multiprocessing.connection.Connection`, each as a concurrent ``AsyncLLM.generate`` stream
with output kind ``DELTA``, so the wall time of each request's first token is its own.

Messages are plain dicts keyed by ``op``. Parent to child: ``submit`` (``rid``, ``prompt``,
``max_tokens``, ``kv_transfer_params``), ``metrics``, ``stop``. Child to parent: ``ready``,
``done`` (one per request, as soon as it finishes), ``metrics`` and ``fatal``. Nothing here
imports vLLM at module level: the parent process (a test run with warnings as errors) never
imports it. :class:`EngineProcess` is the parent's handle: start, send, bounded waits, and a
close that kills the child's whole process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

__all__ = [
    "PROMPT_SOURCES",
    "EngineError",
    "EngineProcess",
    "EngineSpec",
    "engine_main",
    "log_tail",
]

#: The labels of vLLM's ``vllm:prompt_tokens_by_source`` counter.
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

_BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class EngineSpec:
    """Everything a child needs to build its engine; picklable, so it crosses ``spawn``.

    ``role`` is ``"prefill"``, ``"decode"`` or ``"single"``; it only names the engine in logs.
    ``env`` is applied on top of the harness's offline defaults before vLLM is imported.
    """

    name: str
    model_dir: str
    log_path: str
    role: str = "single"
    kv_transfer_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    block_size: int = 32
    max_model_len: int = 512
    seed: int = 0


def _prepare_process(spec: EngineSpec) -> None:
    """Own process group, log file on fds 1 and 2, environment for vLLM."""
    # Already a group leader (or not allowed): the parent then falls back to kill().
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    log_fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    env = {**_BASE_ENV, **spec.env}
    os.environ.update(env)
    print(f"[harness] {spec.name} ({spec.role}) pid {os.getpid()} env {env}", flush=True)


def _build_engine(spec: EngineSpec) -> Any:
    """An ``AsyncLLM`` on the tiny checkpoint: float32, eager, no tokenizer."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kv_config = None
    if spec.kv_transfer_config is not None:
        kv_config = KVTransferConfig(**spec.kv_transfer_config)
    args = AsyncEngineArgs(
        model=spec.model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=spec.block_size,
        enforce_eager=True,
        max_model_len=spec.max_model_len,
        seed=spec.seed,
        kv_transfer_config=kv_config,
        disable_log_stats=False,
    )
    return AsyncLLM.from_engine_args(args)


def _prompt_counters() -> dict[str, float]:
    """This process's ``vllm:prompt_tokens_by_source`` counters, summed over engines."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    counters = dict.fromkeys(PROMPT_SOURCES, 0.0)
    for metric in get_metrics_snapshot():
        if metric.name == "vllm:prompt_tokens_by_source" and isinstance(metric, Counter):
            source = metric.labels.get("source", "")
            counters[source] = counters.get(source, 0.0) + float(metric.value)
    return counters


async def _generate(llm: Any, conn: Connection, msg: dict[str, Any]) -> None:
    """Run one request to its end and report it: tokens, first-token and finish wall times."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = msg.get("kv_transfer_params")
    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=int(msg["max_tokens"]),
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": params} if params is not None else None,
    )
    reply: dict[str, Any] = {"op": "done", "rid": msg["rid"], "t_submit": time.time()}
    tokens: list[int] = []
    t_first: float | None = None
    kv_params: dict[str, Any] | None = None
    try:
        prompt = TokensPrompt(prompt_token_ids=list(msg["prompt"]))
        async for out in llm.generate(prompt, sampling, request_id=msg["rid"]):
            new = list(out.outputs[0].token_ids) if out.outputs else []
            if new and t_first is None:
                t_first = time.time()
            tokens.extend(new)
            if out.finished:
                kv_params = out.kv_transfer_params
        reply["error"] = None
    except Exception as exc:  # reported per request, the engine keeps serving
        reply["error"] = f"{type(exc).__name__}: {exc}"
    reply.update(
        t_done=time.time(), t_first=t_first, token_ids=tokens, kv_transfer_params=kv_params
    )
    conn.send(reply)


async def _serve(llm: Any, conn: Connection) -> None:
    """Serve ``submit`` / ``metrics`` until ``stop`` or until the parent's end of the pipe closes."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def on_readable() -> None:
        try:
            inbox.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            inbox.put_nowait({"op": "stop", "why": "parent closed the pipe"})

    loop.add_reader(conn.fileno(), on_readable)
    tasks: set[asyncio.Task[None]] = set()
    while True:
        msg = await inbox.get()
        if msg["op"] == "submit":
            task = asyncio.create_task(_generate(llm, conn, msg))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif msg["op"] == "metrics":
            conn.send({"op": "metrics", "counters": _prompt_counters()})
        elif msg["op"] == "stop":
            print(f"[harness] stop: {msg.get('why', 'asked by the parent')}", flush=True)
            break
    loop.remove_reader(conn.fileno())
    for task in tasks:
        task.cancel()


def _run(spec: EngineSpec, conn: Connection) -> None:
    """Build the engine, report ready, serve, shut the engine down."""
    t0 = time.time()
    llm = _build_engine(spec)
    try:
        conn.send({"op": "ready", "pid": os.getpid(), "startup_s": time.time() - t0})
        asyncio.run(_serve(llm, conn))
    finally:
        llm.shutdown()
        # AsyncLLM.__del__ shuts down again; let it run now, not during interpreter teardown
        # (where it fails with "'NoneType' object is not callable").
        del llm
        gc.collect()


def engine_main(conn: Connection, spec: EngineSpec) -> None:
    """Entry point of an engine child process (the target of a ``spawn`` ``Process``)."""
    _prepare_process(spec)
    try:
        _run(spec, conn)
    except BaseException:
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError, ValueError):
            conn.send({"op": "fatal", "error": text})
        raise
    finally:
        conn.close()


# --- the parent's handle on a child ----------------------------------------------------------

_STOP_GRACE_S = 20.0
_LOG_TAIL_CHARS = 4000


class EngineError(RuntimeError):
    """An engine child died, failed to start or did not answer in time."""


def log_tail(log_path: Path, chars: int = _LOG_TAIL_CHARS) -> str:
    """The last ``chars`` characters of a log file ("" if it cannot be read)."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class EngineProcess:
    """One engine child: start, send, bounded receive, and a kill that leaves no orphans."""

    def __init__(self, spec: EngineSpec) -> None:
        """Start the child at once; :meth:`wait_ready` waits for its engine."""
        self.spec = spec
        self.name = spec.name
        self.log_path = Path(spec.log_path)
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        # Not a daemon: a daemonic child may not start vLLM's EngineCore process.
        self.proc = ctx.Process(target=engine_main, args=(child_conn, spec), name=spec.name)
        self.proc.start()
        child_conn.close()
        self.startup_s: float | None = None

    def fail(self, why: str) -> EngineError:
        """An :class:`EngineError` naming this engine, ``why`` and the tail of its log."""
        code = self.proc.exitcode
        state = "running" if code is None else f"exited with code {code}"
        return EngineError(
            f"{self.name} engine (pid {self.proc.pid}, {state}): {why}\n"
            f"--- tail of {self.log_path} ---\n{log_tail(self.log_path)}"
        )

    def send(self, msg: dict[str, Any]) -> None:
        """Send one message; a broken pipe becomes an :class:`EngineError`."""
        try:
            self.conn.send(msg)
        except (OSError, ValueError) as exc:
            raise self.fail(f"could not send {msg.get('op')!r}: {exc}") from exc

    def read(self) -> dict[str, Any]:
        """Read the message waiting on the pipe; a closed pipe or ``fatal`` raises."""
        try:
            msg: dict[str, Any] = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise self.fail("the engine process ended") from None
        if msg.get("op") == "fatal":
            lines = str(msg.get("error", "")).strip().splitlines() or ["(no traceback)"]
            raise self.fail(f"the engine failed: {lines[-1]}")
        return msg

    def wait_for(self, deadline: float, what: str) -> dict[str, Any]:
        """The next message from this engine, or :class:`EngineError` by ``deadline``
        (a ``time.monotonic()`` value)."""
        left = deadline - time.monotonic()
        ready = wait([self.conn, self.proc.sentinel], timeout=max(left, 0.0))
        if self.conn in ready:
            return self.read()
        if ready:  # the sentinel alone: the process ended without a word
            self.proc.join(timeout=5)
            raise self.fail(f"the process ended while {what}")
        raise self.fail(f"no answer while {what} (timed out)")

    def wait_ready(self, deadline: float) -> None:
        """Wait (until ``deadline``) for the engine's ``ready`` message."""
        msg = self.wait_for(deadline, "starting its engine")
        if msg.get("op") != "ready":
            raise self.fail(f"expected 'ready', got {msg.get('op')!r}")
        self.startup_s = float(msg.get("startup_s", 0.0))

    def counters(self, deadline: float) -> dict[str, float]:
        """This engine's ``vllm:prompt_tokens_by_source`` counters (cumulative)."""
        self.send({"op": "metrics"})
        msg = self.wait_for(deadline, "reading its metrics")
        if msg.get("op") != "metrics":
            raise self.fail(f"expected 'metrics', got {msg.get('op')!r}")
        return {str(k): float(v) for k, v in msg["counters"].items()}

    def close(self) -> None:
        """Ask the engine to stop, give it a moment, then kill its whole process group."""
        if self.proc.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self.conn.send({"op": "stop"})
            self.proc.join(timeout=_STOP_GRACE_S)
        pid = self.proc.pid
        if pid is not None:
            # The child leads its own group: this reaches vLLM's EngineCore and workers too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()
