"""The KV geometry of a vLLM worker, read off the KV cache tensors it registers.

vLLM hands the connector one tensor per attention layer. kvfsm reads their shapes instead of
assuming one backend's:

* CPU (layout "LBHNC"): `(num_blocks, heads, block_size, 2 * head_dim)`, each token's K and V
  side by side per head: kvfsm's "HNC" page layout, one region per layer.
* FlashAttention-style `(2, num_blocks, block_size, heads, head_dim)`: K and V in two halves of
  the layer's tensor, tokens first: split K/V regions, "NHD".
* MLA `(num_blocks, block_size, latent_dim)`: one latent region per layer, replicated on every
  TP rank.

Anything else is refused at start-up with the shape that was found.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvfsm.layout import KvGeometry

__all__ = ["LayoutError", "geometry_of"]


class LayoutError(ValueError):
    """The KV cache tensors have a shape or placement kvfsm cannot move; the message says which."""


def _natural(name: str) -> list[Any]:
    # "layers.10" after "layers.9": both engines must list the layers in the same order.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def geometry_of(
    kv_caches: Mapping[str, Any],
    *,
    block_size: int,
    num_kv_heads: int,
    tp_size: int,
    tp_rank: int,
) -> tuple[KvGeometry, list[Any]]:
    """This rank's geometry and its region buffers (layer-major) from vLLM's per-layer tensors.

    `num_kv_heads` is the model's total; `block_size` the scheduler's (a backend splitting
    blocks into smaller kernel blocks is refused: block ids would not mean the same thing).
    """
    if not kv_caches:
        raise LayoutError("no KV cache tensors were registered")
    names = sorted(kv_caches, key=_natural)
    tensors = [kv_caches[n] for n in names]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or len({t.dtype for t in tensors}) != 1:
        raise LayoutError(f"the layers' KV tensors differ in shape or dtype: {sorted(shapes)}")
    shape = shapes.pop()
    common = {"num_layers": len(tensors), "dtype_bytes": tensors[0].element_size()}
    common |= {"tp_size": tp_size, "tp_rank": tp_rank}
    if len(shape) == 4 and shape[3] % 2 == 0:  # CPU LBHNC
        num_blocks, heads, tokens, width = shape
        fields = {"num_blocks": num_blocks, "block_size": tokens, "head_dim": width // 2}
        fields |= {"num_kv_heads": heads * tp_size, "kv_layout": "HNC"}
        buffers = tensors
    elif len(shape) == 5 and shape[0] == 2:  # K and V halves, tokens first
        _, num_blocks, tokens, heads, head_dim = shape
        fields = {"num_blocks": num_blocks, "block_size": tokens, "head_dim": head_dim}
        fields |= {"num_kv_heads": heads * tp_size, "kv_layout": "NHD", "split_kv": True}
        buffers = [half for t in tensors for half in (t[0], t[1])]
    elif len(shape) == 3:  # MLA latent
        num_blocks, tokens, latent = shape
        fields = {"num_blocks": num_blocks, "block_size": tokens, "head_dim": latent}
        fields |= {"num_kv_heads": 1, "mla": True}
        num_kv_heads = 1
        buffers = tensors
    else:
        raise LayoutError(f"KV cache tensors of shape {shape} are not a layout kvfsm knows")
    if fields["block_size"] != block_size:
        raise LayoutError(
            f"the KV tensors hold {fields['block_size']}-token blocks, the scheduler"
            f" {block_size}-token ones; set a block size the attention backend uses as is"
        )
    if fields["num_kv_heads"] != num_kv_heads:
        raise LayoutError(
            f"{fields['num_kv_heads'] // tp_size} KV heads per rank x TP {tp_size} is not the"
            f" model's {num_kv_heads}: replicated KV heads are not supported"
        )
    _check_buffers(names, buffers)
    return KvGeometry(**common, **fields), buffers


def _check_buffers(names: list[str], buffers: list[Any]) -> None:
    per_layer = len(buffers) // len(names)
    bad = sorted({names[i // per_layer] for i, b in enumerate(buffers) if not b.is_contiguous()})
    if bad:
        raise LayoutError(f"KV tensors must be contiguous to be registered with NIXL: {bad}")
