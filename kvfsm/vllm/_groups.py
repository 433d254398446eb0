"""`KvGroups`: an engine's KV cache groups as kvfsm moves them, and the blocks of each it moves.

vLLM's hybrid allocator gives every group (full attention, sliding window, Mamba state) its own
block ids per request, from one shared pool: a block id belongs to one group at a time, and every
group's layers overlay the same KV tensors. So moving block `b` through every registered tensor
moves exactly what group `b` belongs to holds, and one request's transfer is the concatenation
of its groups' blocks, group by group, each cut to what the receiver needs:

* full attention: every block;
* sliding window: the blocks holding the window of the token after the moved ones, exactly those
  vLLM's allocator gives D for that many computed tokens (earlier ones are out of the window;
  vLLM frees them on P and never allocates them on D);
* Mamba: the one block holding the running state (after the speculative scratch slots), with P
  stopping one token short of the prompt so that D computes the last token from state N-1.

P and D cut alike because both derive the cut from the same groups (the handshake compares
`describe()`) and the same number of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvfsm.vllm._settings import SettingsError
from kvfsm.wire import BlockIds

__all__ = ["GroupCut", "KvGroups", "joined"]


class GroupCut(msgspec.Struct, frozen=True):
    """What one group moves of a request's blocks: `kind` names the group ("full",
    "sliding_window", "mamba"); `keep` is how many trailing blocks (None: all); `scratch` the
    trailing speculative slots a Mamba group holds beyond its state block."""

    kind: str
    keep: int | None = None
    scratch: int = 0
    detail: str = ""
    window: int = 0
    """A sliding window's tokens (0: none)."""
    block_size: int = 0
    """Tokens per block of a sliding-window group."""

    def cut(self, blocks: Sequence[int], tokens: int | None = None) -> list[int]:
        """The blocks of this group that move, in token order, when the request has `tokens`
        computed tokens (None: unknown, the most a window can need)."""
        ids = list(blocks)
        if self.window and tokens is not None:
            # vLLM's SlidingWindowManager skips the tokens before the next token's window.
            skipped = max(0, tokens - self.window + 1) // self.block_size
            keep = max(0, -(-tokens // self.block_size) - skipped)
            return ids[-keep:] if keep else []
        if self.kind == "mamba":
            if not ids:
                return ids
            ids = ids[: len(ids) - min(self.scratch, len(ids) - 1)]
            return ids[-1:]
        return ids if self.keep is None else ids[-self.keep :] if self.keep else []


class KvGroups(msgspec.Struct, frozen=True):
    """The transferable KV cache groups of one engine, in vLLM's group order."""

    cuts: tuple[GroupCut, ...]
    ids: tuple[int, ...]
    """vLLM's ids of these groups (groups vLLM does not transfer are left out)."""
    count: int
    """All of vLLM's groups, transferred or not (the length of its per-group block lists)."""
    page_bytes: int = 0
    """Bytes between consecutive blocks of a KV tensor (0: unknown)."""
    block_size: int = 0
    """Tokens per block of the attention groups (0: none)."""

    @classmethod
    def single(cls) -> KvGroups:
        """One full-attention group (vLLM without its hybrid allocator)."""
        return cls((GroupCut("full"),), (0,), 1)

    @classmethod
    def of(cls, kv_cache_config: Any) -> KvGroups:
        """The groups of vLLM's `KVCacheConfig`; `SettingsError` names any group kvfsm cannot
        move (chunked local attention, cross attention, sink or sparse attention, ...)."""
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            MambaSpec,
            MLAAttentionSpec,
            SlidingWindowSpec,
        )

        groups = kv_cache_config.kv_cache_groups
        ids = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(groups))))
        cuts, refused = [], []
        for i in ids:
            spec = groups[i].kv_cache_spec
            kind = type(spec)
            if kind in (FullAttentionSpec, MLAAttentionSpec):
                cuts.append(GroupCut("full"))
            elif kind is SlidingWindowSpec:
                keep = -(-spec.sliding_window // spec.block_size) + 1
                cuts.append(
                    GroupCut(
                        "sliding_window",
                        keep,
                        detail=str(spec.sliding_window),
                        window=spec.sliding_window,
                        block_size=spec.block_size,
                    )
                )
            elif kind is MambaSpec:
                scratch = int(spec.num_speculative_blocks)
                cuts.append(GroupCut("mamba", scratch=scratch, detail=_mamba_detail(spec)))
            else:
                refused.append(f"group {i} ({kind.__name__})")
        if refused:
            raise SettingsError(
                "KvfsmConnector moves full-attention, sliding-window and Mamba KV cache groups;"
                " this model has " + ", ".join(refused)
            )
        if not cuts:
            raise SettingsError("KvfsmConnector: the model has no transferable KV cache group")
        tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or ()
        page = int(tensors[0].block_stride) if tensors else 0
        sizes = [
            groups[i].kv_cache_spec.block_size
            for i, c in zip(ids, cuts, strict=True)
            if c.kind != "mamba"
        ]
        return cls(tuple(cuts), ids, len(groups), page, int(sizes[0]) if sizes else 0)

    @property
    def hybrid(self) -> bool:
        """More than one group, or one that does not move every block."""
        return len(self.cuts) > 1 or self.cuts[0].kind != "full"

    @property
    def has_mamba(self) -> bool:
        """A Mamba group: P stops one prompt token short (`prompt_backoff`)."""
        return any(c.kind == "mamba" for c in self.cuts)

    @property
    def prompt_backoff(self) -> int:
        """Trailing prompt tokens P leaves for D to compute (vLLM's convention: Mamba's state
        after N-1 tokens moves, and D derives state N by computing the last token itself)."""
        return 1 if self.has_mamba else 0

    def describe(self) -> str:
        """The groups as both engines must agree on them (part of the handshake's check)."""
        return "+".join(f"{c.kind}({c.detail})" if c.detail else c.kind for c in self.cuts)

    def blocks(self, block_ids: Any, tokens: int | None = None) -> BlockIds:
        """The blocks to move, every group's cut concatenated, from vLLM's block ids (one list
        per group, or one list with a single group) of a request with `tokens` computed."""
        return joined(self.cut(block_ids, tokens))

    def cut(self, block_ids: Any, tokens: int | None = None) -> list[list[int]]:
        """The blocks each transferred group moves (see `blocks`)."""
        if not isinstance(block_ids, tuple | list) or not block_ids:
            return [[int(b) for b in np.asarray(block_ids).ravel()]] if len(self.cuts) == 1 else []
        if not isinstance(block_ids[0], list | tuple):
            if len(self.cuts) != 1:
                raise ValueError(f"one block list for {len(self.cuts)} KV cache groups")
            return [self.cuts[0].cut(block_ids, tokens)]
        if len(block_ids) != self.count:
            raise ValueError(f"{len(block_ids)} block lists for {self.count} KV cache groups")
        return [c.cut(block_ids[i], tokens) for c, i in zip(self.cuts, self.ids, strict=True)]


def joined(groups: list[list[int]]) -> BlockIds:
    """Every group's cut blocks (from `KvGroups.cut`) as one array, in group order."""
    return np.asarray([b for group in groups for b in group], dtype=np.int32)


def _mamba_detail(spec: Any) -> str:
    shapes = "x".join(str(s) for s in spec.shapes) if hasattr(spec, "shapes") else ""
    return f"{shapes}:{getattr(spec, 'page_size_bytes', '')}"
