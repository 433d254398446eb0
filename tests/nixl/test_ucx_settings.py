"""The UCX settings a real `NixlFabric` applies where the environment sets none, and that the
user's own setting wins: READs of CUDA memory over CUDA IPC (pull over VRAM on one host)."""

from __future__ import annotations

import os

import pytest

from kvfsm.fabric import UCX_DEFAULTS, NixlFabric

_GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


def test_reads_of_cuda_memory_may_use_cuda_ipc_unless_the_user_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(_GET_ZCOPY, raising=False)  # restored after the test
    fabric = NixlFabric("ucx-defaults")
    fabric.close()
    assert os.environ[_GET_ZCOPY] == UCX_DEFAULTS[_GET_ZCOPY] == "y"

    monkeypatch.setenv(_GET_ZCOPY, "n")
    fabric = NixlFabric("ucx-user")
    fabric.close()
    assert os.environ[_GET_ZCOPY] == "n"
