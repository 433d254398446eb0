"""KV geometries of real models, for the demo and the benchmarks (one TP rank's share is derived
from these by TP size and rank; the number of blocks by a memory cap)."""

from __future__ import annotations

import msgspec

from kvfsm.layout import KvGeometry

__all__ = ["DTYPES", "MAX_BLOCKS", "MIN_BLOCKS", "MODELS", "model_geometry"]

MODELS: dict[str, KvGeometry] = {
    # Llama-3-8B: 32 layers, 8 KV heads (GQA), head dim 128, fp16; 2 MiB per 16-token block.
    "llama3-8b": KvGeometry(
        num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, block_size=16, num_blocks=1
    ),
    # DeepSeek-V2-Lite: 27 layers of MLA latent KV (512 + 64 rope dims), bf16, replicated on
    # every TP rank; 486 KiB per 16-token block.
    "deepseek-v2-lite": KvGeometry(
        num_layers=27,
        num_kv_heads=1,
        head_dim=576,
        dtype_bytes=2,
        block_size=16,
        num_blocks=1,
        mla=True,
    ),
    # A small model for tests: 4 layers, 8 KV heads (TP up to 8), head dim 32; 64 KiB per block.
    "tiny": KvGeometry(
        num_layers=4, num_kv_heads=8, head_dim=32, dtype_bytes=2, block_size=16, num_blocks=1
    ),
}


DTYPES: dict[str, str] = {"llama3-8b": "float16", "deepseek-v2-lite": "bfloat16", "tiny": "float16"}
"""Each preset's KV dtype, for the compatibility hash."""


MIN_BLOCKS, MAX_BLOCKS = 8, 1 << 16
"""The fewest and most blocks a demo rank's cache holds, whatever `--memory-mib` says."""


def model_geometry(
    model: str, *, tp_size: int, block_size: int, memory_mib: float, max_blocks: int = MAX_BLOCKS
) -> KvGeometry:
    """`model`'s geometry for one rank of a TP group, with as many blocks as fit `memory_mib`
    (at least 8, at most `max_blocks`). ValueError for an unknown model or a TP size that does
    not split its heads."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}: one of {', '.join(MODELS)}")
    one = msgspec.structs.replace(MODELS[model], tp_size=tp_size, block_size=block_size)
    per_block = one.block_len * one.num_regions
    blocks = min(max_blocks, max(MIN_BLOCKS, int(memory_mib * 2**20) // per_block))
    return msgspec.structs.replace(one, num_blocks=blocks)
