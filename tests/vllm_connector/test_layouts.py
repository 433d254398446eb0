"""vLLM 0.32's GPU KV cache layouts, made on host memory by vLLM's own code
(`create_kv_cache_views`, what the GPU model runner calls): the connector names each layout from
the tensors' strides, takes the one it asks vLLM for (LBHNC), LBNHC (tokens first), BLHNC and
BLNHC (blocks outermost) and MLA in all of them, and refuses the rest at start-up in one line naming the layout and the setting that
fixes it. vLLM's own `resolve_kv_cache_layout`, given each GPU backend's declared layouts and
KvfsmConnector's request, resolves to LBHNC wherever the backend admits it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvfsm.core import Abort, Admit
from kvfsm.vllm import KvfsmConnector
from kvfsm.vllm._geometry import (
    REQUIRED_LAYOUT,
    LayoutError,
    geometry_of,
    kernel_blocks,
    layout_of,
)

pytestmark = pytest.mark.vllm

LAYERS, BLOCKS, HEADS, TOKENS, HEAD_DIM = 3, 6, 4, 16, 8


def _views(spec: Any, layout: KVCacheLayout, kernel: int | None = None) -> dict[str, Any]:
    """Per-layer views of one backing buffer, as vLLM's GPU model runner makes them."""
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, BLOCKS, LAYERS, layout, fixed_strides=(None,) * 5
    )
    size = spec.page_size_bytes * BLOCKS * LAYERS
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    tensor = KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel)
    return dict(zip(names, views, strict=True))


def _attention(dtype: torch.dtype = torch.float16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=dtype)


def _mla() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=576, dtype=torch.float16)


def _geometry(views: dict[str, Any], heads: int = HEADS, mla: bool = False) -> Any:
    return geometry_of(
        views, block_size=TOKENS, num_kv_heads=heads * 2, tp_size=2, tp_rank=1, mla=mla
    )


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_each_layout_is_named_from_the_tensors(layout: KVCacheLayout) -> None:
    view = next(iter(_views(_attention(), layout).values()))
    assert layout_of(view) == layout.name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=str)
def test_lbhnc_is_taken_as_heads_first_pages(dtype: torch.dtype) -> None:
    views = _views(_attention(dtype), KVCacheLayout.LBHNC)
    g, buffers = _geometry(views)
    assert (g.kv_layout, g.num_layers, g.num_blocks, g.block_size) == ("HNC", LAYERS, BLOCKS, 16)
    assert (g.heads_per_rank, g.head_dim, g.dtype_bytes) == (HEADS, HEAD_DIM, dtype.itemsize)
    assert [b.data_ptr() for b in buffers] == [v.data_ptr() for v in views.values()]
    assert g.region_bytes == buffers[0].numel() * buffers[0].element_size()


def test_lbnhc_is_taken_as_tokens_first_pages() -> None:
    views = _views(_attention(), KVCacheLayout.LBNHC)
    g, buffers = _geometry(views)
    assert (g.kv_layout, g.num_layers, g.heads_per_rank, g.head_dim) == ("NHC", LAYERS, HEADS, 8)
    view = views["model.layers.1.self_attn.attn"]
    assert buffers[1].data_ptr() == view.data_ptr() and buffers[1].is_contiguous()
    assert buffers[1].numel() * buffers[1].element_size() == g.region_bytes


_MOVED = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")


@pytest.mark.parametrize(("name", "page"), [("BLHNC", "HNC"), ("BLNHC", "NHC")])
def test_blocks_outermost_are_one_interleaved_span(name: str, page: str) -> None:
    views = _views(_attention(), KVCacheLayout[name])
    g, buffers = _geometry(views)
    assert (g.kv_layout, g.interleaved, g.num_layers) == (page, True, LAYERS)
    (span,) = buffers
    assert span.data_ptr() == views["model.layers.0.self_attn.attn"].data_ptr()
    assert span.numel() * span.element_size() == g.kv_bytes == g.block_stride * BLOCKS


@pytest.mark.parametrize(
    "layout", [x for x in KVCacheLayout if x.name not in _MOVED], ids=lambda x: x.name
)
def test_other_layouts_are_refused_naming_the_layout_and_the_fix(layout: KVCacheLayout) -> None:
    with pytest.raises(LayoutError, match=f"as {layout.name}; .*VLLM_KV_CACHE_LAYOUT=LBHNC"):
        _geometry(_views(_attention(), layout))


@pytest.mark.parametrize(
    "layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.LHBNC], ids=lambda x: x.name
)
def test_mla_is_read_by_the_model_in_any_layer_outermost_layout(layout: KVCacheLayout) -> None:
    """vLLM 0.32 hands an MLA layer over as [B, 1, N, latent]: one latent region per layer,
    replicated on every TP rank (not one head whose K and V are the latent's halves)."""
    views = _views(_mla(), layout)
    assert next(iter(views.values())).shape == (BLOCKS, 1, TOKENS, 576)
    g, buffers = _geometry(views, heads=1, mla=True)
    assert g.mla and (g.head_dim, g.heads_per_rank, g.values_per_token) == (576, 1, 1)
    assert g.block_len == TOKENS * 576 * 2 and len(buffers) == LAYERS


@pytest.mark.parametrize(
    "layout", [x for x in KVCacheLayout if x.is_block_outermost], ids=lambda x: x.name
)
def test_mla_blocks_outermost_is_one_interleaved_span(layout: KVCacheLayout) -> None:
    # One head: BLHNC, BLNHC and BHLNC put the same bytes in the same places.
    g, buffers = _geometry(_views(_mla(), layout), heads=1, mla=True)
    assert g.mla and g.interleaved and len(buffers) == 1


def test_kernel_blocks_are_read_and_vllms_blocks_become_kernel_ids() -> None:
    """A backend viewing 16-token blocks as 8-token kernel blocks (as FlashMLA views bigger
    ones in 64): the geometry counts kernel blocks, and vLLM's block `b` is kernel blocks
    `2b` and `2b + 1` in every event the connector hands the engine."""
    views = _views(_attention(), KVCacheLayout.LBHNC, kernel=8)
    g, _ = _geometry(views)
    assert (g.block_size, g.num_blocks) == (8, 2 * BLOCKS)
    admit = kernel_blocks(Admit("r", np.array([2, 5], dtype=np.int32)), 2)
    assert admit.blocks.tolist() == [4, 5, 10, 11] and admit.blocks.dtype == np.int32
    assert kernel_blocks(Abort("r"), 2) == Abort("r")
    assert kernel_blocks(admit, 1) is admit


def test_blocks_that_do_not_split_into_the_views_are_refused() -> None:
    views = {"a": torch.zeros(8, 2, 24, 128)}
    with pytest.raises(LayoutError, match="24-token blocks, which do not divide the"):
        geometry_of(views, block_size=32, num_kv_heads=4, tp_size=2, tp_rank=0)


# The layouts vLLM 0.32's GPU attention backends declare (`supported_kv_cache_layouts`), most
# preferred first; None: any (vLLM's default order then applies). Read from vLLM 0.32's source.
_L = KVCacheLayout
_BACKENDS: dict[str, tuple[KVCacheLayout, ...] | None] = {
    "FlashAttention": None,
    "Triton": None,
    "FlashInfer (before Blackwell)": None,
    "FlashInfer (Blackwell), b12x": (_L.LBHNC, _L.BLHNC),
    "ROCm attention": (_L.LHBNC, _L.LBHNC),
    "flex attention, turboquant": (_L.LBNHC,),
    "DeepSeek sparse-MLA indexer": (_L.BLHNC, _L.BLNHC),
}


def _resolved(declared: tuple[KVCacheLayout, ...] | None) -> KVCacheLayout:
    backend = SimpleNamespace(supported_kv_cache_layouts=lambda: declared)
    supported = [x.name for x in get_supported_kv_cache_layouts([backend])]
    transfer = KVTransferConfig(
        kv_connector="KvfsmConnector",
        kv_connector_module_path="kvfsm.vllm",
        kv_role="kv_producer",
    )
    config = SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_layout=None), kv_transfer_config=transfer
    )
    return resolve_kv_cache_layout(config, [supported])


@pytest.mark.parametrize("backend", list(_BACKENDS))
def test_vllm_resolves_the_layout_kvfsm_asks_for_wherever_the_backend_admits_it(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    declared = _BACKENDS[backend]
    layout = _resolved(declared)
    assert KvfsmConnector.get_required_kvcache_layout(None) == REQUIRED_LAYOUT
    if declared is None or _L.LBHNC in declared:
        assert layout is _L.LBHNC
    elif layout.name in _MOVED:  # the backend's own choice, which kvfsm moves too
        assert layout is declared[0]
        assert _geometry(_views(_attention(), layout))[0].kv_layout in ("HNC", "NHC")
    else:  # the connector refuses what vLLM made, at start-up, in one line
        assert layout is declared[0]
        with pytest.raises(LayoutError, match=f"as {layout.name}; "):
            _geometry(_views(_attention(), layout))


def test_a_refusal_names_the_attention_backend() -> None:
    """The start-up refusal names the backend vLLM runs the layers with (its forward context)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvfsm.vllm._connector import backends_of

    layer = SimpleNamespace(attn_backend=CPUAttentionBackend)
    context = {"model.layers.0.self_attn.attn": layer}
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context))
    assert backends_of(config, [*context, "model.layers.1.self_attn.attn"]) == "CPU_ATTN"
    assert backends_of(SimpleNamespace(compilation_config=SimpleNamespace()), context) == "unknown"
