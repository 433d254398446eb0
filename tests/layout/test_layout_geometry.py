"""KvGeometry: derived sizes computed by hand, validation, msgspec round trip."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvfsm.layout import KvGeometry

_BASE: dict[str, Any] = dict(
    num_layers=2, num_kv_heads=4, head_dim=8, dtype_bytes=2, block_size=16, num_blocks=10
)


def test_joint_sizes() -> None:
    g = KvGeometry(**_BASE, tp_size=2, tp_rank=1)
    assert g.heads_per_rank == 2
    assert g.first_head == 2
    assert g.regions_per_layer == 1 and g.num_regions == 2
    assert g.segments_per_block == 2
    assert g.head_bytes == 16 * 8 * 2 == 256
    assert g.segment_len == 2 * 256
    assert g.bytes_per_token == 2 * 8 * 2 * 2 == 64  # K and V of 2 heads
    assert g.block_len == 64 * 16 == 1024
    assert g.region_bytes == 10240
    assert g.kv_bytes == 20480


def test_split_sizes() -> None:
    g = KvGeometry(**_BASE, split_kv=True)
    assert g.heads_per_rank == 4
    assert g.regions_per_layer == 2 and g.num_regions == 4
    assert g.segments_per_block == 1
    assert g.bytes_per_token == 4 * 8 * 2 == 64
    assert g.block_len == g.segment_len == 1024


def test_mla_replicates_every_head() -> None:
    g = KvGeometry(**{**_BASE, "num_kv_heads": 1, "head_dim": 576}, tp_size=4, tp_rank=3, mla=True)
    assert g.heads_per_rank == 1
    assert g.first_head == 0
    assert g.segments_per_block == 1 and g.num_regions == 2
    assert g.block_len == 576 * 2 * 16


def test_for_rank_and_msgspec_round_trip() -> None:
    g = KvGeometry(**_BASE, tp_size=4, tp_rank=0)
    assert g.for_rank(3).tp_rank == 3 and g.for_rank(3).first_head == 3
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(g), type=KvGeometry) == g


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_kv_heads": 6, "tp_size": 4}, "num_kv_heads=6 is not divisible by tp_size=4"),
        ({"num_kv_heads": 2, "tp_size": 4}, "not divisible by tp_size=4"),
        ({"num_layers": 0}, "num_layers must be a positive integer, got 0"),
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"dtype_bytes": -2}, "dtype_bytes must be a positive integer, got -2"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"num_blocks": 0}, "num_blocks must be a positive integer"),
        ({"tp_size": 0}, "tp_size must be a positive integer"),
        ({"block_size": 2.0}, "block_size must be a positive integer, got 2.0"),
        ({"num_layers": True}, "num_layers must be a positive integer, got True"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank 2 does not lie in [0, tp_size=2)"),
        ({"tp_rank": -1}, "tp_rank -1 does not lie"),
        ({"mla": True, "split_kv": True}, "split_kv must be False"),
        ({"split_kv": 1}, "split_kv must be a bool"),
    ],
)
def test_invalid_geometries_say_why(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="invalid KV geometry") as info:
        KvGeometry(**{**_BASE, **changes})
    assert message in str(info.value)


def test_every_problem_is_listed() -> None:
    with pytest.raises(ValueError) as info:
        KvGeometry(**{**_BASE, "num_layers": 0, "head_dim": 0})
    assert "num_layers" in str(info.value) and "head_dim" in str(info.value)


def test_mla_ignores_head_divisibility() -> None:
    g = KvGeometry(**{**_BASE, "num_kv_heads": 1}, tp_size=8, tp_rank=5, mla=True)
    assert g.heads_per_rank == 1


def test_decoding_validates() -> None:
    bad = msgspec.msgpack.encode({**_BASE, "num_kv_heads": 3, "tp_size": 2})
    with pytest.raises(msgspec.ValidationError, match="not divisible"):
        msgspec.msgpack.decode(bad, type=KvGeometry)
