"""KV caches made by vLLM's own code (`create_kv_cache_views`, as the GPU model runner makes
them, here on host memory), read by the connector's `geometry_of`, registered with real NIXL
agents and moved P -> D by kvfsm engines, push and pull: every byte of every token D should hold
is compared through vLLM's logical `[B, H, N, C]` views, whatever the layout. TP sizes differ
(head slices), D's blocks hold twice P's tokens, D has a prefix-cache hit; FP16, FP8 and MLA;
blocks outermost on one side or both (one row per block); kernel blocks."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvfsm.core import Admit, Consumer, Finished, Identity, Mode, PrefillFinished, Producer
from kvfsm.fabric import NixlFabric
from kvfsm.layout import logical_to_kernel
from kvfsm.runtime import Engine, KvCache
from kvfsm.sidechannel import LocalDirectory
from kvfsm.vllm._geometry import geometry_of, kernel_blocks

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

LAYERS, HEADS, HEAD_DIM, BLOCKS = 2, 8, 4, 12
_names = itertools.count()


class _Rank:
    """One engine rank whose KV cache vLLM's code laid out."""

    def __init__(
        self,
        core: Producer | Consumer,
        spec: Any,
        layout: KVCacheLayout,
        *,
        heads: int,
        mla: bool,
        directory: LocalDirectory,
        device: str = "cpu",
        kernel: int | None = None,
    ) -> None:
        me = core.identity
        self.views = _views(spec, layout, device, kernel)
        geometry, buffers = geometry_of(
            {f"layers.{i}": v for i, v in enumerate(self.views)},
            block_size=spec.block_size,
            num_kv_heads=heads,
            tp_size=me.tp_size,
            tp_rank=me.rank,
            mla=mla,
        )
        self.geometry = geometry
        self.split = spec.block_size // geometry.block_size  # kernel blocks per vLLM block
        self.engine = Engine(
            core,
            NixlFabric(me.agent, mem_type="VRAM" if device == "cuda" else "DRAM"),
            KvCache(geometry, buffers),
            directory.view(),
            time.monotonic,
        )
        directory.publish(self.engine.agent, self.engine.info)

    def close(self) -> None:
        self.engine.close()
        self.engine.fabric.close()


def _views(
    spec: Any, layout: KVCacheLayout, device: str = "cpu", kernel: int | None = None
) -> list[Any]:
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, BLOCKS, LAYERS, layout, fixed_strides=(None,) * 5
    )
    size = spec.page_size_bytes * BLOCKS * LAYERS
    tensor = KVCacheTensor(
        size=size,
        layers=[f"l{i}" for i in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    return [
        v.view(torch.uint8 if v.element_size() == 1 else torch.int16)
        for v in create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel)
    ]


def _expected(layer: int, tokens: Any, heads: Any, width: int) -> Any:
    """What every element holds, by layer, token position, model-wide head and content index:
    shape (tokens, heads, width), small enough for one byte."""
    t = tokens[:, None, None]
    h = heads[None, :, None]
    c = torch.arange(width)[None, None, :]
    return (1 + layer * 37 + t * 11 + h * 5 + c * 3) % 251


def _fill(rank: _Rank, blocks: list[int], tokens: int) -> None:
    g = rank.geometry
    n = g.block_size
    heads = torch.arange(g.first_head, g.first_head + g.heads_per_rank)
    for layer, view in enumerate(rank.views):
        for i, block in enumerate(blocks):
            if i * n >= tokens:  # a kernel block past the request's last token
                break
            span = torch.arange(i * n, min(tokens, (i + 1) * n))
            values = _expected(layer, span, heads, view.shape[3])  # (tokens, heads, width)
            view[block, :, : span.numel(), :] = values.permute(1, 0, 2).to(view)
    if rank.views[0].is_cuda:
        torch.cuda.synchronize()  # what the device fence does in the connector


def _check(rank: _Rank, blocks: list[int], first: int, tokens: int) -> int:
    """Compare tokens [first, tokens) D holds in `blocks` (from token `first` on); the count."""
    g = rank.geometry
    n = g.block_size
    heads = torch.arange(g.first_head, g.first_head + g.heads_per_rank)
    compared = 0
    for layer, view in enumerate(rank.views):
        for i, block in enumerate(blocks):
            if first + i * n >= tokens:
                break
            span = torch.arange(first + i * n, min(tokens, first + (i + 1) * n))
            want = _expected(layer, span, heads, view.shape[3]).permute(1, 0, 2).to(view)
            got = view[block, :, : span.numel(), :]
            assert torch.equal(got, want), (layer, block, i)
            compared += got.numel()
    return compared


def _spec(block_size: int, heads: int, dtype: torch.dtype, mla: bool) -> Any:
    if mla:
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=24, dtype=dtype)
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=HEAD_DIM, dtype=dtype
    )


def _move(
    mode: Mode,
    layout: KVCacheLayout,
    p_tp: int,
    d_tp: int,
    p_bs: int,
    d_bs: int,
    *,
    dtype: torch.dtype = torch.float16,
    mla: bool = False,
    hit: int = 0,
    tokens: int = 45,
    d_layout: KVCacheLayout | None = None,
    device: str = "cpu",
    kernel: int | None = None,
) -> int:
    """Move one request of `tokens` tokens P -> D (D in `d_layout`, default P's); D already
    holds its first `hit` blocks. Returns the descriptor rows the posting side posted."""
    n = next(_names)
    heads = 1 if mla else HEADS
    directory = LocalDirectory(time.monotonic)
    p = [
        _Rank(
            Producer(Identity(f"VP{n}", r, p_tp), mode),
            _spec(p_bs, heads // p_tp if not mla else 1, dtype, mla),
            layout,
            heads=heads,
            mla=mla,
            directory=directory,
            device=device,
            kernel=kernel,
        )
        for r in range(p_tp)
    ]
    d = [
        _Rank(
            Consumer(Identity(f"VD{n}", r, d_tp), mode),
            _spec(d_bs, heads // d_tp if not mla else 1, dtype, mla),
            d_layout or layout,
            heads=heads,
            mla=mla,
            directory=directory,
            device=device,
        )
        for r in range(d_tp)
    ]
    try:
        p_blocks = [BLOCKS - 1 - 2 * i for i in range(-(-tokens // p_bs))]  # scattered
        d_all = [1 + i for i in range(-(-tokens // d_bs))]
        d_blocks = d_all[hit:]
        for rank in p:  # vLLM's block ids, as the connector hands them to the engine
            ids = np.array(p_blocks, dtype=np.int32)
            _fill(rank, logical_to_kernel(ids, rank.split).tolist(), tokens)
            for event in (Admit("req-0000000a", ids), PrefillFinished("req-0000000a", ids)):
                rank.engine.submit(kernel_blocks(event, rank.split))
        for rank in d:
            ids = np.array(d_blocks, dtype=np.int32)
            rank.engine.submit(Admit("req-0000000b", ids, f"VP{n}", p_tp, "req-0000000a"))
        finished: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while len(finished) < p_tp + d_tp:
            assert time.monotonic() < deadline, f"not all ended: {finished}"
            for rank in p + d:
                rank.engine.poll()
                for out in rank.engine.take_outputs():
                    if isinstance(out, Finished):
                        finished[rank.engine.agent] = out.state
        assert set(finished.values()) == {"done"}, finished
        for rank in d:
            assert _check(rank, d_blocks, hit * d_bs, tokens) > 0
        posting = p if mode == "push" else d
        return sum(rank.engine.counters["descriptors"] for rank in posting)
    finally:
        for rank in p + d:
            rank.close()


_LAYOUTS = [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC]


_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("layout", _LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1), (2, 4)])
def test_every_token_of_every_head_arrives(
    layout: KVCacheLayout, mode: Mode, p_tp: int, d_tp: int, device: str
) -> None:
    # On a GPU (VRAM registered with NIXL) where vLLM and CUDA are both present.
    _move(mode, layout, p_tp, d_tp, 16, 16, device=device)


@pytest.mark.parametrize("layout", _LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_fp8_kv_and_a_d_prefix_hit(layout: KVCacheLayout, mode: Mode) -> None:
    _move(mode, layout, 1, 2, 16, 16, dtype=torch.float8_e4m3fn, hit=1)


@pytest.mark.parametrize(
    "layout", [*_LAYOUTS, KVCacheLayout.LHBNC, KVCacheLayout.BHLNC], ids=lambda x: x.name
)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_mla_arrives_whole_on_every_d_rank(layout: KVCacheLayout, p_tp: int, d_tp: int) -> None:
    _move("pull", layout, p_tp, d_tp, 16, 16, mla=True)


@pytest.mark.parametrize("layout", _LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_d_blocks_twice_ps(layout: KVCacheLayout, mode: Mode) -> None:
    _move(mode, layout, 1, 2, 16, 32)


@pytest.mark.parametrize("layout", _LAYOUTS, ids=lambda x: x.name)
def test_d_blocks_twice_ps_across_tp_with_a_prefix_hit(layout: KVCacheLayout) -> None:
    _move("push", layout, 2, 4, 16, 32, hit=1, tokens=70)


@pytest.mark.parametrize(
    ("p_layout", "d_layout"),
    [(KVCacheLayout.BLHNC, KVCacheLayout.LBHNC), (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)],
    ids=lambda x: x.name,
)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_blocks_outermost_beside_layers_outermost(
    p_layout: KVCacheLayout, d_layout: KVCacheLayout, mode: Mode
) -> None:
    # The same page layout, blocks outermost on one side only: one row per layer and block.
    _move(mode, p_layout, 1, 2, 16, 16, d_layout=d_layout)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_blocks_outermost_on_both_sides_move_one_row_per_block(mode: Mode) -> None:
    blocks = -(-45 // 16)
    assert _move(mode, KVCacheLayout.BLHNC, 1, 1, 16, 16) == blocks
    assert _move(mode, KVCacheLayout.LBHNC, 1, 1, 16, 16) == blocks * LAYERS


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC], ids=lambda x: x.name)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_kernel_blocks_of_ps_scheduler_blocks(layout: KVCacheLayout, mode: Mode) -> None:
    # P's backend views its 32-token blocks as 16-token kernel blocks (as FlashMLA views bigger
    # blocks in 64-token ones); D keeps 32-token blocks. vLLM's block ids become kernel ids.
    _move(mode, layout, 1, 2, 32, 32, kernel=16, tokens=70)
