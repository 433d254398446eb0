"""The VRAM path on a real GPU: KV caches in CUDA tensors (one per region), registered with NIXL
as VRAM, moved between engines by UCX's CUDA transports, in push and pull, across TP pairs.

Skipped where no CUDA device is present (CI has none); run on a GPU machine. Bytes are checked
with the same recognisable pattern as everywhere else: written on the host, copied to P's GPU
memory, and D's GPU memory copied back to the host and compared from D's own geometry."""

from __future__ import annotations

import collections
import itertools
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from kvfsm.core import Admit, Consumer, Finished, Identity, Mode, PrefillFinished, Producer
from kvfsm.fabric import NixlFabric
from kvfsm.layout import KvGeometry
from kvfsm.runtime import Engine, KvCache
from kvfsm.sidechannel import LocalDirectory
from kvfsm.sim import check_request, request_seed, write_request

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

_MODEL = KvGeometry(
    num_layers=2, num_kv_heads=4, head_dim=64, dtype_bytes=2, block_size=16, num_blocks=32
)
_names = itertools.count()


class _GpuRank:
    """An engine whose KV cache lives in CUDA tensors, with a host mirror for the pattern."""

    def __init__(
        self, core: Producer | Consumer, geometry: KvGeometry, directory: LocalDirectory
    ) -> None:
        self.tensors = [
            torch.zeros(geometry.region_bytes, dtype=torch.uint8, device="cuda")
            for _ in range(geometry.num_regions)
        ]
        self.kv = KvCache(geometry, self.tensors)
        self.host = KvCache.allocate(geometry)
        fabric = NixlFabric(core.identity.agent, mem_type="VRAM")
        self.engine = Engine(core, fabric, self.kv, directory.view(), time.monotonic)
        directory.publish(self.engine.agent, self.engine.info)

    def upload(self) -> None:
        for tensor, region in zip(self.tensors, self.host.regions(), strict=True):
            tensor.copy_(torch.from_numpy(region))
        torch.cuda.synchronize()

    def download(self) -> None:
        torch.cuda.synchronize()
        for tensor, region in zip(self.tensors, self.host.regions(), strict=True):
            region[:] = tensor.cpu().numpy()


def _rank(tp: int, rank: int) -> KvGeometry:
    return msgspec.structs.replace(_MODEL, tp_size=tp, tp_rank=rank)


def test_a_cuda_kv_cache_is_vram() -> None:
    rank = _GpuRank(Producer(Identity(f"G{next(_names)}"), "push"), _MODEL, LocalDirectory())
    try:
        assert rank.kv.mem_type == "VRAM" and rank.kv.layout.device == torch.cuda.current_device()
        assert rank.kv.layout.base_addresses == tuple(t.data_ptr() for t in rank.tensors)
        with pytest.raises(TypeError, match="not visible from the host"):
            rank.kv.regions()
    finally:
        rank.engine.close()
        rank.engine.fabric.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1)])
def test_gpu_engines_move_verified_kv(mode: Mode, p_tp: int, d_tp: int) -> None:
    n = next(_names)
    directory = LocalDirectory(time.monotonic)
    p_ranks = [
        _GpuRank(Producer(Identity(f"GP{n}", r, p_tp), mode), _rank(p_tp, r), directory)
        for r in range(p_tp)
    ]
    d_ranks = [
        _GpuRank(Consumer(Identity(f"GD{n}", r, d_tp), mode), _rank(d_tp, r), directory)
        for r in range(d_tp)
    ]
    everyone = p_ranks + d_ranks
    try:
        requests = [(f"r{i}", np.array([2 * i, 2 * i + 1], dtype=np.int32)) for i in range(8)]
        for key, blocks in requests:
            for rank in p_ranks:
                write_request(rank.host, request_seed(key), blocks, unit_tokens=16)
        for rank in p_ranks:
            rank.upload()
        finished: dict[tuple[str, str], str] = {}
        for key, blocks in requests:
            for rank in p_ranks:
                rank.engine.submit(Admit(f"{key}-0000000a", blocks))
                rank.engine.submit(PrefillFinished(f"{key}-0000000a", blocks))
            for rank in d_ranks:
                d_blocks = blocks[::-1] + 16  # other blocks, in another order
                rank.engine.submit(
                    Admit(f"{key}-0000000b", d_blocks, f"GP{n}", p_tp, f"{key}-0000000a")
                )
        deadline = time.monotonic() + 60
        while len(finished) < len(requests) * len(everyone):
            assert time.monotonic() < deadline, f"not all ended: {len(finished)}"
            for rank in everyone:
                rank.engine.poll()
                for out in rank.engine.take_outputs():
                    if isinstance(out, Finished):
                        finished[(rank.engine.agent, out.request_id)] = out.state
        assert set(finished.values()) == {"done"}
        for rank in d_ranks:
            rank.download()
            for key, blocks in requests:
                check = check_request(
                    rank.host,
                    request_seed(key),
                    blocks[::-1] + 16,
                    unit_tokens=16,
                    first_token=0,
                    tokens=32,
                )
                assert check.wrong == 0 and check.compared == 2 * rank.host.block_bytes, key
    finally:
        for rank in everyone:
            rank.engine.close()
            rank.engine.fabric.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_p_exposes_kv_only_once_the_device_wrote_it(mode: Mode) -> None:
    """P's KV is written by a kernel queued behind a deliberately slow one (about a second of
    GPU time), as a forward pass leaves it when vLLM hands over the finished prefill: through
    the `DeviceFence` (as the connector does on a GPU) D receives what the kernel wrote."""
    from kvfsm.vllm._fence import DeviceFence

    n = next(_names)
    directory = LocalDirectory(time.monotonic)
    p = _GpuRank(Producer(Identity(f"GP{n}"), mode), _MODEL, directory)
    d = _GpuRank(Consumer(Identity(f"GD{n}"), mode), _MODEL, directory)
    held: collections.deque[Any] = collections.deque()  # the fence's thread hands over here
    fence = DeviceFence(held.append, f"GP{n}")
    try:
        blocks = np.array([3, 4], dtype=np.int32)
        write_request(p.host, request_seed("slow"), blocks, unit_tokens=16)
        p.engine.submit(Admit("slow-0000000a", blocks))
        d.engine.submit(Admit("slow-0000000b", blocks + 8, f"GP{n}", 1, "slow-0000000a"))
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles before the KV write
        for tensor, region in zip(p.tensors, p.host.regions(), strict=True):
            tensor.copy_(torch.from_numpy(region).pin_memory(), non_blocking=True)
        fence.written()  # the forward pass is queued: vLLM's wait_for_save
        fence.pass_on([PrefillFinished("slow-0000000a", blocks)])  # the next step's metadata
        finished: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while len(finished) < 2:
            assert time.monotonic() < deadline, f"not all ended: {finished}"
            while held:
                p.engine.submit(held.popleft())
            for rank in (p, d):
                rank.engine.poll()
                for out in rank.engine.take_outputs():
                    if isinstance(out, Finished):
                        finished[rank.engine.agent] = out.state
        assert set(finished.values()) == {"done"}
        d.download()
        check = check_request(
            d.host, request_seed("slow"), blocks + 8, unit_tokens=16, first_token=0, tokens=32
        )
        assert check.wrong == 0 and check.compared == 2 * d.host.block_bytes
    finally:
        fence.close()
        for rank in (p, d):
            rank.engine.close()
            rank.engine.fabric.close()
