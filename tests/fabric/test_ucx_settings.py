"""The UCX settings a real `NixlFabric` applies where the environment sets none, and that the
user's own setting wins: READs of CUDA memory over CUDA IPC (pull over VRAM on one host)."""

from __future__ import annotations

import os

import pytest

from kvfsm.fabric import UCX_DEFAULTS, NixlFabric

pytestmark = pytest.mark.nixl

_GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


def test_a_vram_fabric_lets_reads_of_cuda_memory_use_cuda_ipc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # setenv first: a delenv of an absent variable is not undone, and the fabric's setting
    # would leak into later tests' subprocesses (a UCX without CUDA warns of it on stdout).
    monkeypatch.setenv(_GET_ZCOPY, "")
    monkeypatch.delenv(_GET_ZCOPY)
    NixlFabric("ucx-dram").close()
    assert _GET_ZCOPY not in os.environ  # UCX without CUDA would warn of it
    NixlFabric("ucx-vram", mem_type="VRAM").close()
    assert os.environ[_GET_ZCOPY] == UCX_DEFAULTS["VRAM"][_GET_ZCOPY] == "y"


def test_the_users_own_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_GET_ZCOPY, "n")
    NixlFabric("ucx-user", mem_type="VRAM").close()
    assert os.environ[_GET_ZCOPY] == "n"
