"""Integrity (`verify`): P's checksum of each transfer's bytes, D's check before it reports them
received. The checksum itself (numpy and torch agree; a flipped bit or moved row changes it),
and end to end on the simulated fabric and on real NIXL agents, push and pull, TP 1 -> 2: every
transfer verified and served, and a byte flipped after P took its checksum (the negative
control) fails its request with the blocks invalid and `corrupted` counted."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kvfsm.core import CoreConfig, Mode, ReportFailed, ReportReceived
from kvfsm.layout import KvGeometry
from kvfsm.runtime import Checksum, KvCache, corrupt_after_checksum, kv_checksum
from kvfsm.sim import FAST_CONFIG, Cluster

_RNG = np.random.default_rng(7)
_DATA = _RNG.integers(0, 256, size=(1 << 20) + 4096, dtype=np.uint8)


def _sum(*parts: object) -> int:
    total = Checksum()
    for part in parts:
        total.update(part)
    return total.value


def test_numpy_and_torch_compute_the_same_checksum_in_any_split() -> None:
    whole = _sum(_DATA)
    assert _sum(torch.from_numpy(_DATA.copy())) == whole  # what a GPU computes
    assert _sum(_DATA[:8192], _DATA[8192:]) == whole  # split where rows end


@pytest.mark.parametrize("at", [0, 7, 4095, len(_DATA) - 1])
@pytest.mark.parametrize("bit", [0, 7])
def test_a_flipped_bit_anywhere_changes_it(at: int, bit: int) -> None:
    flipped = _DATA.copy()
    flipped[at] ^= 1 << bit
    assert _sum(flipped) != _sum(_DATA)


def test_rows_in_another_order_change_it() -> None:
    a, b = _DATA[:4096], _DATA[4096:8192]
    assert _sum(a, b) != _sum(b, a)


def test_rows_of_part_words_are_padded_alike() -> None:
    g = KvGeometry(
        num_layers=1, num_kv_heads=1, head_dim=3, dtype_bytes=2, block_size=1, num_blocks=4
    )
    kv = KvCache.allocate(g)
    kv.regions()[0][:] = np.arange(len(kv.regions()[0]), dtype=np.uint8)
    rows = kv.layout.descriptors()[:3]  # 6-byte rows: each padded to a word
    assert rows[0, 1] % 8
    assert kv_checksum(kv, rows) != kv_checksum(kv, rows[::-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_computes_the_hosts_checksum_of_its_kv() -> None:
    g = KvGeometry(
        num_layers=2, num_kv_heads=2, head_dim=64, dtype_bytes=2, block_size=8, num_blocks=8
    )
    host = KvCache.allocate(g)
    host.regions()[0][:] = _DATA[: g.region_bytes]
    device = KvCache(g, [torch.from_numpy(host.buffers[0].copy()).cuda()])
    rows = np.arange(0, 2 * g.num_blocks, 3)
    assert kv_checksum(device, device.layout.descriptors()[rows]) == kv_checksum(
        host, host.layout.descriptors()[rows]
    )


def test_sample_checks_one_request_in_eight() -> None:
    config = msgspec.structs.replace(CoreConfig(), verify="sample")
    chosen = sum(config.checksums(f"req-{i}") for i in range(8000))
    assert 800 < chosen < 1200
    assert not CoreConfig().checksums("req-0")


def _cluster(mode: Mode, fabric: str) -> Cluster:
    config = msgspec.structs.replace(FAST_CONFIG, verify="all")
    return Cluster(mode, config=config, d_tp=2, fabric=fabric)  # type: ignore[arg-type]


FABRICS = ["sim", pytest.param("nixl", marks=pytest.mark.nixl)]


@pytest.mark.parametrize("fabric", FABRICS)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_every_transfer_is_verified_and_served(mode: Mode, fabric: str) -> None:
    c = _cluster(mode, fabric)
    try:
        for key in ("a", "b"):
            c.admit(key, 3)
            c.finish_prefill(key)
        c.settle()
        assert {k: set(pr.final.values()) for k, pr in c.requests.items()} == {
            "a": {"done"},
            "b": {"done"},
        }
        for agent in c.agents("D"):
            counters = c.engines[agent].side.counters
            assert counters["verified"] == 2 and counters["corrupted"] == 0
        assert c.ledger.violations == [] and c.ledger.quiescence() == []
    finally:
        c.close()


@pytest.mark.parametrize("fabric", FABRICS)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_byte_flipped_after_the_checksum_fails_its_request(mode: Mode, fabric: str) -> None:
    c = _cluster(mode, fabric)
    reports: list[tuple[str, object]] = []
    c.output_listeners.append(lambda agent, out: reports.append((agent, out)))
    c.engines["P#0"].checksum = corrupt_after_checksum(times=1)  # the first transfer, to D#0
    try:
        c.admit("bad", 3)
        c.finish_prefill("bad")
        c.settle()
        pr = c.requests["bad"]
        assert pr.final["D#0"] == "failed" and pr.final["D#1"] == "done"
        assert c.engines["D#0"].side.counters["corrupted"] == 1
        failed = [o for a, o in reports if a == "D#0" and isinstance(o, ReportFailed)]
        assert [list(o.blocks) for o in failed] == [list(pr.d_blocks)]  # reported invalid
        assert not [o for a, o in reports if a == "D#0" and isinstance(o, ReportReceived)]
        assert c.ledger.violations == [] and c.ledger.quiescence() == []
    finally:
        c.close()
