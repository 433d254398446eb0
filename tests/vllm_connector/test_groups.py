"""`KvGroups`: which of a request's blocks each kind of KV cache group moves, and the groups kvfsm
refuses by name. Built from vLLM's own spec classes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvfsm.vllm import SettingsError
from kvfsm.vllm._groups import KvGroups

pytestmark = pytest.mark.vllm

_ATTN = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}


def _config(*specs: Any) -> SimpleNamespace:
    groups = [KVCacheGroupSpec([f"layers.{i}"], s) for i, s in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups, transfer_group_ids=tuple(range(len(groups))))


def _mamba(speculative: int = 0) -> MambaSpec:
    return MambaSpec(
        block_size=512,
        shapes=((3, 544), (8, 64, 16)),
        dtypes=(torch.float32,) * 2,
        num_speculative_blocks=speculative,
    )


def test_each_group_moves_what_the_receiver_needs_in_group_order() -> None:
    groups = KvGroups.of(
        _config(
            SlidingWindowSpec(**_ATTN, sliding_window=64),
            FullAttentionSpec(**_ATTN),
            _mamba(speculative=2),
        )
    )
    # 7 blocks: the window of 64 tokens needs the last ceil(64/32)+1 = 3 of the sliding group;
    # the Mamba group's running state is its last slot before the 2 speculative ones.
    block_ids = ([0, 0, 0, 0, 11, 12, 13], [1, 2, 3, 4, 5, 6, 7], [0, 30, 31, 32])
    assert groups.blocks(block_ids).tolist() == [11, 12, 13, 1, 2, 3, 4, 5, 6, 7, 30]
    assert groups.hybrid and groups.has_mamba and groups.prompt_backoff == 1
    assert groups.describe().startswith("sliding_window(64)+full+mamba(")


def test_a_short_request_moves_every_block_it_has() -> None:
    groups = KvGroups.of(
        _config(SlidingWindowSpec(**_ATTN, sliding_window=64), FullAttentionSpec(**_ATTN))
    )
    assert groups.blocks(([5], [6])).tolist() == [5, 6]
    assert groups.blocks(()).tolist() == []
    with pytest.raises(ValueError, match="2 KV cache groups"):
        groups.blocks([5, 6])


def test_one_full_attention_group_moves_everything_as_before() -> None:
    groups = KvGroups.of(_config(FullAttentionSpec(**_ATTN)))
    assert not groups.hybrid and groups.prompt_backoff == 0
    assert groups.blocks([3, 4, 5]).tolist() == groups.blocks(([3, 4, 5],)).tolist() == [3, 4, 5]


def test_a_group_kvfsm_cannot_move_is_refused_by_name() -> None:
    chunked = ChunkedLocalAttentionSpec(**_ATTN, attention_chunk_size=128)
    with pytest.raises(SettingsError, match=r"group 1 \(ChunkedLocalAttentionSpec\)"):
        KvGroups.of(_config(FullAttentionSpec(**_ATTN), chunked))


@pytest.mark.parametrize("window", [64, 50, 100])
def test_p_moves_exactly_the_sliding_blocks_vllm_gives_d_at_every_length(window: int) -> None:
    """D holds the blocks vLLM's SlidingWindowManager keeps for the tokens it loads; P, which
    may still hold earlier ones, moves exactly that many, the last of its own. (A fixed
    ceil(W/B)+1 moved 3 where D held 2 at some lengths, and D failed those loads.)"""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    groups = KvGroups.of(
        _config(SlidingWindowSpec(**_ATTN, sliding_window=window), FullAttentionSpec(**_ATTN))
    )
    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    for tokens in range(1, 400):
        blocks = -(-tokens // 32)
        skipped = SlidingWindowManager.get_num_skipped_tokens(manager, tokens) // 32
        p_ids = list(range(100, 100 + blocks))  # P freed nothing yet
        d_ids = list(range(200 + skipped, 200 + blocks))  # vLLM allocates no skipped block
        p_cut, d_cut = (groups.cut((ids, ids), tokens)[0] for ids in (p_ids, d_ids))
        assert d_cut == d_ids and p_cut == p_ids[len(p_ids) - len(d_ids) :], tokens
