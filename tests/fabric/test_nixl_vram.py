"""What `NixlFabric` passes to NIXL for CUDA tensors (VRAM) and CPU tensors (DRAM).

No GPU here: an agent that records its calls stands in for NIXL's, so this checks the arguments
kvfsm gives NIXL, not NIXL itself (tests/fabric/test_nixl_fabric.py runs the real agent over DRAM)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvfsm.fabric import NixlFabric


class _RecordingAgent:
    """Answers like a NIXL agent and records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            return f"{name}-result"

        return call


class _CudaTensor:
    """The attributes of a CUDA tensor that registration reads."""

    is_cuda = True

    def __init__(self, ptr: int, numel: int, element_size: int, device: int) -> None:
        self._ptr, self._numel, self._size = ptr, numel, element_size
        self.device = type("Device", (), {"index": device})()

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._size

    def is_contiguous(self) -> bool:
        return True


def test_a_cuda_tensor_is_registered_as_vram_on_its_device() -> None:
    agent = _RecordingAgent()
    fabric = NixlFabric("gpu#0", mem_type="VRAM", agent=agent)
    fabric.register_memory(_CudaTensor(0x7F0000000000, 1024, 2, device=3))  # type: ignore[arg-type]
    assert agent.calls[0] == ("get_reg_descs", ([(0x7F0000000000, 2048, 3, "")], "VRAM"))
    assert agent.calls[1] == ("register_memory", ("get_reg_descs-result",))
    rows = np.array([[0x7F0000000000, 1024, 3]], dtype=np.int64)
    fabric.prep_xfer_dlist(None, rows)
    name, (passed, mem_type) = agent.calls[2]
    assert name == "get_xfer_descs" and mem_type == "VRAM" and np.array_equal(passed, rows)
    assert agent.calls[3] == (
        "prep_xfer_dlist",
        ("NIXL_INIT_AGENT", "get_xfer_descs-result", "VRAM"),
    )


def test_a_cpu_tensor_is_registered_as_dram() -> None:
    agent = _RecordingAgent()
    fabric = NixlFabric("cpu#0", agent=agent)
    tensor = torch.zeros(16, dtype=torch.float16)
    fabric.register_memory(tensor)  # type: ignore[arg-type]
    assert agent.calls[0] == ("get_reg_descs", ([(tensor.data_ptr(), 32, 0, "")], "DRAM"))


def test_memory_of_the_wrong_kind_is_refused() -> None:
    vram = NixlFabric("gpu#1", mem_type="VRAM", agent=_RecordingAgent())
    with pytest.raises(TypeError, match="transfers VRAM; this buffer is DRAM"):
        vram.register_memory(np.zeros(8, dtype=np.uint8))
    with pytest.raises(TypeError, match="contiguous"):
        NixlFabric("cpu#1", agent=_RecordingAgent()).register_memory(torch.zeros(4, 4).t())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="DRAM or VRAM"):
        NixlFabric("x#0", mem_type="HBM", agent=_RecordingAgent())
