"""The KV geometry of a vLLM worker, read off the KV cache tensors it registers.

vLLM 0.32 hands the connector one tensor per attention layer, logically `[B, H, N, C]`
(blocks, heads, tokens, content), its strides following the engine's `KVCacheLayout`
(`vllm/v1/kv_cache_layout.py`). kvfsm reads the layout from the strides instead of assuming
one backend's:

* LBHNC (the layout the connector asks vLLM for, `REQUIRED_LAYOUT`): each layer one contiguous
  region, each block its heads one after the other, each token's K and V side by side: kvfsm's
  "HNC" page layout, one region per layer. A run of heads is contiguous, so TP sizes may differ.
* LBNHC (vLLM's first choice where no backend declares a set): each layer one contiguous region,
  each block its tokens one after the other: kvfsm's "NHC" pages; a head slice is one run per
  token.
* BLHNC, BLNHC (blocks outermost): the same pages, every layer's page of a block together, so
  the cache is one region span ("interleaved"); between two such engines a whole block of every
  layer moves as one row.
* MLA (recognised by the model, not the tensor's rank): `[B, 1, N, latent]`, one latent region
  per layer, replicated on every TP rank; layers outermost or blocks outermost.
* The legacy split `(2, num_blocks, block_size, heads, head_dim)`: K and V in two halves of the
  layer's tensor, tokens first: split K/V regions, "NHD".

Any other layout (LHBNC and BHLNC for attention: a layer's page of a block is not one run) is
refused at start-up in one line that names it and the setting that fixes it
(`VLLM_KV_CACHE_LAYOUT=LBHNC`). A backend that views the scheduler's blocks as smaller kernel
blocks gives a geometry in kernel blocks; `kernel_blocks` turns vLLM's block ids into theirs.

With several KV cache groups (sliding window beside full attention), vLLM overlays one layer of
each group on the same tensor (a block id belongs to one group at a time): such aliases are one
region, registered once.

A Mamba group's pages hold its conv and SSM states (padded to the attention pages' size) where
the attention layers overlaid on them hold K and V: no head layout fits both. `page_geometry_of`
moves such pages whole, as opaque bytes (one byte-wide "head" per TP rank, tokens-first), which
pairs rank r of P only with rank r of D, of the same TP size.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np

from kvfsm.layout import KvGeometry, logical_to_kernel

__all__ = [
    "REQUIRED_LAYOUT",
    "LayoutError",
    "geometry_of",
    "kernel_blocks",
    "layout_of",
    "page_geometry_of",
]

REQUIRED_LAYOUT = "LBHNC"
"""The KV cache layout the connector asks vLLM for: a head slice is one run per block, so it
moves across TP sizes, and the layout vLLM's CPU backend and its NixlConnector use."""


class LayoutError(ValueError):
    """The KV cache tensors have a shape or placement kvfsm cannot move; the message says which."""


def _natural(name: str) -> list[Any]:
    # "layers.10" after "layers.9": both engines must list the layers in the same order.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def layout_of(view: Any) -> str:
    """The name of vLLM's `KVCacheLayout` a per-layer `[B, H, N, C]` view is laid out in, read
    off its strides. Layouts that put the same bytes in the same places (one layer, or one
    head) are named by the first of them."""
    b, h, n, c = view.shape
    sb, sh, sn, _ = view.stride()
    page = h * n * c
    heads_outer = sh > sn
    if sb == page:
        return "LBHNC" if heads_outer or h == 1 else "LBNHC"
    if sb == n * c and sh == b * n * c:
        return "LHBNC"
    if h == 1:  # one head: the block-outermost layouts hold the same bytes
        return "BLHNC"
    if not heads_outer:
        return "BLNHC"
    return "BLHNC" if sh == n * c else "BHLNC"


def geometry_of(
    kv_caches: Mapping[str, Any],
    *,
    block_size: int,
    num_kv_heads: int,
    tp_size: int,
    tp_rank: int,
    mla: bool = False,
) -> tuple[KvGeometry, list[Any]]:
    """This rank's geometry and its region buffers (layer-major) from vLLM's per-layer tensors.

    `num_kv_heads` is the model's total; `block_size` the scheduler's. A backend that views
    the cache in smaller kernel blocks (FlashMLA's 64 tokens under a bigger `--block-size`)
    gives a geometry in kernel blocks: the scheduler's block `b` is kernel blocks
    `b * k .. b * k + k - 1` (`kernel_blocks`). `mla`: the model keeps one latent KV per token
    (vLLM's `model_config.use_mla`).
    """
    if not kv_caches:
        raise LayoutError("no KV cache tensors were registered")
    names, tensors = _regions(kv_caches)
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or len({t.dtype for t in tensors}) != 1:
        raise LayoutError(f"the layers' KV tensors differ in shape or dtype: {sorted(shapes)}")
    shape = shapes.pop()
    common = {"num_layers": len(tensors), "dtype_bytes": tensors[0].element_size()}
    common |= {"tp_size": tp_size, "tp_rank": tp_rank}
    fields, buffers = _read(shape, tensors, tp_size, mla)
    num_kv_heads = 1 if mla else num_kv_heads
    if block_size % fields["block_size"]:
        raise LayoutError(
            f"the KV tensors hold {fields['block_size']}-token blocks, which do not divide the"
            f" scheduler's {block_size}-token ones"
        )
    if fields["num_kv_heads"] != num_kv_heads:
        raise LayoutError(
            f"{fields['num_kv_heads'] // tp_size} KV heads per rank x TP {tp_size} is not the"
            f" model's {num_kv_heads}: replicated KV heads are not supported"
        )
    _check_buffers(names[:1] if len(buffers) == 1 else names, buffers)
    return KvGeometry(**common, **fields), buffers


def _read(
    shape: tuple[int, ...], tensors: list[Any], tp_size: int, mla: bool
) -> tuple[dict[str, Any], list[Any]]:
    """The geometry's fields that the tensors say, and the buffers that hold its regions."""
    fields: dict[str, Any]
    if mla:
        num_blocks, tokens, latent = _latent_shape(shape)
        fields = {"num_blocks": num_blocks, "block_size": tokens, "head_dim": latent}
        fields |= {"num_kv_heads": 1, "mla": True}
        interleaved = _is_interleaved(tensors[0]) if len(shape) == 4 else False
        buffers = [_span(tensors)] if interleaved else [_dense_layer(t) for t in tensors]
        return fields | {"interleaved": interleaved}, buffers
    if len(shape) == 4:  # [B, H, N, C] in one of the layouts kvfsm moves
        page_layout, interleaved = _page_layout(tensors[0])
        num_blocks, heads, tokens, width = shape
        fields = {"num_blocks": num_blocks, "block_size": tokens, "head_dim": width // 2}
        fields |= {"num_kv_heads": heads * tp_size, "kv_layout": page_layout}
        if interleaved:
            return fields | {"interleaved": True}, [_span(tensors)]
        return fields, tensors if page_layout == "HNC" else [_layer_region(t) for t in tensors]
    if len(shape) == 5 and shape[0] == 2:  # K and V halves, tokens first
        _, num_blocks, tokens, heads, head_dim = shape
        fields = {"num_blocks": num_blocks, "block_size": tokens, "head_dim": head_dim}
        fields |= {"num_kv_heads": heads * tp_size, "kv_layout": "NHD", "split_kv": True}
        return fields, [half for t in tensors for half in (t[0], t[1])]
    raise LayoutError(f"KV cache tensors of shape {shape} are not a layout kvfsm knows")


# vLLM's layouts kvfsm moves: the page layout inside a block, and whether blocks come first
# (every layer's page of a block together).
_PAGE_LAYOUTS = {
    "LBHNC": ("HNC", False),
    "LBNHC": ("NHC", False),
    "BLHNC": ("HNC", True),
    "BLNHC": ("NHC", True),
}


def _page_layout(view: Any) -> tuple[str, bool]:
    """kvfsm's page layout of a layer's `[B, H, N, C]` view and whether layers interleave; the
    layouts kvfsm does not move are refused, naming the layout and the fix."""
    name = "LBHNC" if view.is_contiguous() else layout_of(view)
    if name in _PAGE_LAYOUTS:
        return _PAGE_LAYOUTS[name]
    raise LayoutError(
        f"vLLM laid the KV cache out as {name}; kvfsm moves {', '.join(_PAGE_LAYOUTS)} and"
        f" asks vLLM for {REQUIRED_LAYOUT}: the attention backend admits none of them, or"
        f" VLLM_KV_CACHE_LAYOUT chose another. Set VLLM_KV_CACHE_LAYOUT={REQUIRED_LAYOUT} (or"
        f" leave it unset), or choose an attention backend that admits {REQUIRED_LAYOUT}"
        " (docs/vllm.md lists them)"
    )


def _is_interleaved(view: Any) -> bool:
    """Whether a layer's blocks lie further apart than its page (blocks outermost)."""
    b, h, n, c = view.shape
    return bool(b > 1 and view.stride(0) > h * n * c)


def _span(views: list[Any]) -> Any:
    """Block-outermost layers' views as the one contiguous tensor they share: layer `l`'s page
    of block `b` at `(b * layers + l) * page` (refused if vLLM placed them otherwise)."""
    first = views[0]
    page = first[0].numel()
    if first.stride(0) != page * len(views) or any(
        v.data_ptr() != first.data_ptr() + i * page * first.element_size()
        for i, v in enumerate(views)
    ):
        raise LayoutError(
            f"the KV pages (strides {first.stride()}) are not laid out block by block, layer by"
            f" layer; set VLLM_KV_CACHE_LAYOUT={REQUIRED_LAYOUT}"
        )
    return first.as_strided((first.shape[0] * page * len(views),), (1,))


def _layer_region(view: Any) -> Any:
    """A layer-outermost layer's view as the contiguous tensor of its region (every block's
    page, in block order), the bytes NIXL registers."""
    flat = view.as_strided((view.numel(),), (1,))
    if view.stride(0) * view.shape[0] != view.numel():
        raise LayoutError(f"a layer's KV blocks are not one dense region (strides {view.stride()})")
    return flat


def _latent_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(blocks, tokens, latent width) of an MLA layer: `[B, 1, N, latent]` (vLLM 0.32) or
    `[B, N, latent]` (earlier)."""
    if len(shape) == 4 and shape[1] == 1:
        return shape[0], shape[2], shape[3]
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    raise LayoutError(f"an MLA layer's KV tensor of shape {shape} is not [B, 1, N, latent]")


def _dense_layer(view: Any) -> Any:
    """An MLA layer's view, which is contiguous in any layer-outermost layout (its one head
    makes LBHNC, LBNHC and LHBNC the same bytes)."""
    if view.is_contiguous():
        return view
    raise LayoutError(f"an MLA layer's KV is not one dense region (strides {view.stride()})")


def kernel_blocks(event: Any, split: int) -> Any:
    """`event` with its scheduler block ids as the kernel block ids they hold (`split` kernel
    blocks each); events without blocks, and any event when `split` is 1, as they are."""
    blocks = getattr(event, "blocks", None)
    if split == 1 or blocks is None:
        return event
    kernel = logical_to_kernel(blocks, split).astype(np.int32)
    return msgspec.structs.replace(event, blocks=kernel)


def page_geometry_of(
    kv_caches: Mapping[str, Any], *, page_bytes: int, block_size: int, tp_size: int, tp_rank: int
) -> tuple[KvGeometry, list[Any]]:
    """This rank's geometry and region buffers when its KV pages are opaque (a Mamba group):
    one region per distinct tensor, `page_bytes` per block, moved whole."""
    if not kv_caches:
        raise LayoutError("no KV cache tensors were registered")
    if page_bytes % (2 * block_size):
        raise LayoutError(f"KV pages of {page_bytes} bytes do not split into {block_size} tokens")
    firsts: dict[int, Any] = {}
    for name in sorted(kv_caches, key=_natural):
        firsts.setdefault(kv_caches[name].data_ptr(), kv_caches[name])
    num_blocks = int(next(iter(firsts.values())).shape[0])
    buffers = [_pages(t, num_blocks, page_bytes) for t in firsts.values()]
    _check_buffers([f"region {i}" for i in range(len(buffers))], buffers)
    geometry = KvGeometry(
        num_layers=len(buffers),
        num_kv_heads=tp_size,
        head_dim=page_bytes // (2 * block_size),
        dtype_bytes=1,
        block_size=block_size,
        num_blocks=num_blocks,
        tp_size=tp_size,
        tp_rank=tp_rank,
        kv_layout="NHD",
    )
    return geometry, buffers


def _pages(tensor: Any, num_blocks: int, page_bytes: int) -> Any:
    """`num_blocks` pages of `page_bytes` from where `tensor` starts, as one uint8 tensor."""
    import torch

    if tensor.stride(0) * tensor.element_size() != page_bytes:
        raise LayoutError(f"a KV tensor's blocks are not {page_bytes} bytes apart")
    flat = tensor.view(torch.uint8)  # the same bytes, counted in bytes
    return torch.as_strided(flat, (num_blocks * page_bytes,), (1,))


def _regions(kv_caches: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    """One (first layer name, tensor) per distinct tensor, in layer order: layers of different
    groups that vLLM overlays on one tensor share a region."""
    names: list[str] = []
    tensors: list[Any] = []
    seen: dict[int, Any] = {}
    for name in sorted(kv_caches, key=_natural):
        tensor = kv_caches[name]
        first = seen.get(tensor.data_ptr())
        if first is None:
            seen[tensor.data_ptr()] = tensor
            names.append(name)
            tensors.append(tensor)
        elif tuple(first.shape) != tuple(tensor.shape) or first.stride() != tensor.stride():
            raise LayoutError(f"layer {name} overlays another layer's KV with another shape")
    return names, tensors


def _check_buffers(names: list[str], buffers: list[Any]) -> None:
    per_layer = len(buffers) // len(names)
    bad = sorted({names[i // per_layer] for i, b in enumerate(buffers) if not b.is_contiguous()})
    if bad:
        raise LayoutError(f"KV tensors must be contiguous to be registered with NIXL: {bad}")
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers)
    if any(end > nxt for (_, end), (nxt, _) in itertools.pairwise(spans)):
        raise LayoutError("KV tensors of different layers overlap only in part")
