"""Settings for the tests that drive vLLM in-process.

vLLM must find the tiny model's config.json on disk, never on the Hub, so HF_HUB_OFFLINE is set
before anything imports `huggingface_hub` (it reads the variable once, at import). vLLM names a
fresh ZMQ IPC socket under VLLM_RPC_BASE_PATH (the system's temp directory by default) for each
engine and leaves it behind (2,700 had piled up in /tmp on the development machine). They go to
a directory of this session's, removed at its end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_OWN_IPC_DIR = "VLLM_RPC_BASE_PATH" not in os.environ
if _OWN_IPC_DIR:
    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="kvfsm-vllm-ipc-")

# Importing vLLM 0.32 imports torch._dynamo, which imports torch.utils.mkldnn, whose
# `@torch.jit.script_method` decorators raise this DeprecationWarning in torch 2.13 (14 times).
# It is an import-time warning of vLLM's own import chain, not something these tests do; with
# pyproject's `filterwarnings = ["error"]` it would fail collection. Filtered here for the
# collection phase (already under way when this file is imported) and, through
# pytest_configure, for every test phase.
_TORCH_JIT_DEPRECATION = r"`torch\.jit\.script_method` is deprecated"
warnings.filterwarnings("ignore", message=_TORCH_JIT_DEPRECATION, category=DeprecationWarning)


def pytest_configure(config: pytest.Config) -> None:
    """Keep the one vLLM import-time warning above from failing test phases."""
    config.addinivalue_line("filterwarnings", f"ignore:{_TORCH_JIT_DEPRECATION}:DeprecationWarning")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the IPC sockets' directory, if this session made it."""
    if _OWN_IPC_DIR:
        shutil.rmtree(os.environ["VLLM_RPC_BASE_PATH"], ignore_errors=True)
