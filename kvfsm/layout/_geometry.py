"""The shape of one engine rank's paged KV cache, and the byte sizes that follow from it.

Memory model: in every region, block `b` starts at `b * block_len`. With the "HND" page layout
(which head slicing needs) each K or V *segment* of a block holds the rank's heads one after the
other, each head `block_size * head_dim * dtype_bytes` bytes, so the bytes of any run of
consecutive heads are one contiguous range per segment. "NHD" (tokens first, as vLLM's CPU
backend keeps it) moves whole blocks only.

* `split_kv=True`: two regions per layer (K, then V), each block one segment.
* `split_kv=False`: one region per layer, each block a K segment followed by a V segment.
* `mla=True`: one region per layer holding the latent KV, replicated on every TP rank (each block
  one segment, no split across ranks).
"""

from __future__ import annotations

import msgspec

from kvfsm.layout._ids import positive_int

__all__ = ["KvGeometry"]

_POSITIVE_FIELDS = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype_bytes",
    "block_size",
    "num_blocks",
    "tp_size",
)


class KvGeometry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One TP rank's KV cache geometry; model-wide sizes plus this rank's place in the TP group.

    `num_kv_heads` is the model's total; a rank holds `num_kv_heads // tp_size` of them (all of
    them with MLA). Construction (and msgspec decoding) validates, raising ValueError that lists
    every problem.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int
    """Tokens per block."""
    num_blocks: int
    tp_size: int = 1
    tp_rank: int = 0
    split_kv: bool = False
    """K and V in separate regions per layer (True) or one joint region per layer (False)."""
    mla: bool = False
    """Latent KV replicated on every TP rank: no head split."""
    interleaved: bool = False
    """Blocks outermost (vLLM's BLHNC, BLNHC): a block's pages of every layer lie together, one
    after the other, so region `l` starts `l * block_len` after region 0 and its blocks are
    `block_stride` apart. False: each region is its blocks back to back."""
    kv_layout: str = "HND"
    """Order inside a block: "HND" (K segment then V segment, each heads, then tokens: a run of
    heads is contiguous, as a head split between different TP sizes needs), "NHD" (tokens, then
    heads: whole blocks only), "HNC" (heads, then tokens, then each token's K and V side by
    side: vLLM's LBHNC layout; head runs are contiguous too) or "NHC" (tokens, then heads, then
    the K and V of each: vLLM's LBNHC layout; a run of heads is contiguous within each token)."""

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError("invalid KV geometry: " + "; ".join(problems))

    @property
    def heads_per_rank(self) -> int:
        """KV heads this rank holds: all of them with MLA, else an equal share."""
        return self.num_kv_heads if self.mla else self.num_kv_heads // self.tp_size

    @property
    def first_head(self) -> int:
        """Model-wide index of this rank's first head (0 with MLA: every rank holds all)."""
        return 0 if self.mla else self.tp_rank * self.heads_per_rank

    @property
    def regions_per_layer(self) -> int:
        """Registered regions per layer: 2 with split K/V, else 1."""
        return 2 if self.split_kv else 1

    @property
    def num_regions(self) -> int:
        """Registered regions in all, layer-major (L0 K, L0 V, L1 K, ... when split)."""
        return self.num_layers * self.regions_per_layer

    @property
    def values_per_token(self) -> int:
        """Values a region holds per head and token: K and V (2), or one of them / the latent
        KV (1) with split K/V or MLA."""
        return 1 if self.split_kv or self.mla else 2

    @property
    def segments_per_block(self) -> int:
        """Segments inside one block of a region: 2 (K, then V) for a joint HND/NHD region, else
        1 (split K/V, MLA, or HNC/NHC where each token's K and V lie side by side)."""
        return 1 if self.kv_together else self.values_per_token

    @property
    def kv_together(self) -> bool:
        """Each token's K and V lie side by side (HNC, NHC: vLLM 0.32's layouts)."""
        return self.kv_layout in ("HNC", "NHC")

    @property
    def tokens_first(self) -> bool:
        """Tokens are the outer order inside a block (NHD, NHC): a run of heads is contiguous
        only within one token."""
        return self.kv_layout in ("NHD", "NHC")

    @property
    def head_bytes(self) -> int:
        """Bytes of one head in one segment of one block (with HNC/NHC: its K and V together;
        with NHC spread over the block's tokens, contiguous within each)."""
        per_value = self.block_size * self.head_dim * self.dtype_bytes
        return per_value * (self.values_per_token if self.kv_together else 1)

    @property
    def segment_len(self) -> int:
        """Bytes of one segment of a block (all of this rank's heads)."""
        return self.heads_per_rank * self.head_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in one region."""
        return self.heads_per_rank * self.head_dim * self.dtype_bytes * self.values_per_token

    @property
    def block_len(self) -> int:
        """Bytes of one block in one region (the stride between blocks)."""
        return self.bytes_per_token * self.block_size

    @property
    def block_stride(self) -> int:
        """Bytes from one block of a region to the next: `block_len`, or with interleaved
        layers every layer's page of the block."""
        return self.block_len * (self.num_regions if self.interleaved else 1)

    @property
    def region_bytes(self) -> int:
        """Bytes of one region: every block of it (spread over the cache when interleaved)."""
        return self.block_len * self.num_blocks

    @property
    def kv_bytes(self) -> int:
        """Bytes of this rank's whole KV cache, all regions."""
        return self.region_bytes * self.num_regions

    def for_rank(self, tp_rank: int) -> KvGeometry:
        """The same engine's geometry as seen from TP rank `tp_rank`."""
        return msgspec.structs.replace(self, tp_rank=tp_rank)


def _problems(g: KvGeometry) -> list[str]:
    problems: list[str] = []
    for name in _POSITIVE_FIELDS:
        try:
            positive_int(getattr(g, name), name)
        except ValueError as exc:
            problems.append(str(exc))
    for name in ("split_kv", "mla", "interleaved"):
        if not isinstance(getattr(g, name), bool):
            problems.append(f"{name} must be a bool, got {getattr(g, name)!r}")
    if problems:
        # The checks below divide by these fields; they are meaningless until the basics hold.
        return problems
    if isinstance(g.tp_rank, bool) or not isinstance(g.tp_rank, int):
        problems.append(f"tp_rank must be an integer, got {g.tp_rank!r}")
    elif not 0 <= g.tp_rank < g.tp_size:
        problems.append(f"tp_rank {g.tp_rank} does not lie in [0, tp_size={g.tp_size})")
    if not g.mla and g.num_kv_heads % g.tp_size:
        problems.append(
            f"num_kv_heads={g.num_kv_heads} is not divisible by tp_size={g.tp_size}: every rank"
            " must hold an equal number of whole heads (replicated KV heads are not supported)"
        )
    if g.kv_layout not in ("HND", "NHD", "HNC", "NHC"):
        problems.append(f"kv_layout must be 'HND', 'NHD', 'HNC' or 'NHC', got {g.kv_layout!r}")
    elif g.kv_together and g.split_kv:
        problems.append(
            f"{g.kv_layout} keeps each token's K and V together: split_kv must be False"
        )
    if g.interleaved and g.split_kv:
        problems.append("interleaved layers keep each layer's K and V together: split_kv False")
    if g.mla and g.split_kv:
        problems.append("MLA keeps one latent KV region per layer: split_kv must be False")
    return problems
