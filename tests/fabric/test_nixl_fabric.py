"""`NixlFabric` on real NIXL agents (UCX over DRAM) in one process, and the runtime engine driving
P and D over it: the same code the simulated fabric runs, with real bytes checked."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvfsm.core import (
    Admit,
    Consumer,
    Finished,
    Identity,
    Mode,
    PrefillFinished,
    Producer,
    ReportReceived,
)
from kvfsm.fabric import FabricError, NixlFabric, NotFoundError
from kvfsm.layout import KvGeometry
from kvfsm.runtime import Engine, KvCache, RequestTrace
from kvfsm.sidechannel import LocalDirectory
from kvfsm.sim import PatternCheck, check_request, request_seed, write_request

pytestmark = pytest.mark.nixl

_names = itertools.count()
_TIMEOUT = 20.0  # the first UCX connection can be slow; every wait here is bounded


def _rows(buf: np.ndarray, n: int, size: int) -> np.ndarray:
    rows = np.zeros((n, 3), dtype=np.int64)
    rows[:, 0] = buf.ctypes.data + np.arange(n) * size
    rows[:, 1] = size
    return rows


@pytest.fixture
def pair() -> Iterator[tuple[NixlFabric, NixlFabric]]:
    n = next(_names)
    a, b = NixlFabric(f"A{n}"), NixlFabric(f"B{n}")
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_transfer_moves_bytes_and_notifies_the_peer(
    pair: tuple[NixlFabric, NixlFabric], op: str
) -> None:
    a, b = pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    a_buf, b_buf = (dst, src) if op == "READ" else (src, dst)
    a.register_memory(a_buf)
    b.register_memory(b_buf)
    assert a.add_remote_agent(b.get_agent_metadata()) == b.agent_name
    b.add_remote_agent(a.get_agent_metadata())
    local = a.prep_xfer_dlist(None, _rows(a_buf, 4, 1024))
    remote = a.prep_xfer_dlist(b.agent_name, _rows(b_buf, 4, 1024))
    handle = a.make_prepped_xfer(op, local, np.array([0, 2]), remote, np.array([1, 3]), b"note")  # type: ignore[arg-type]
    state, notifs = a.transfer(handle), dict[str, list[bytes]]()
    deadline = time.monotonic() + _TIMEOUT
    while (state == "PROC" or not notifs) and time.monotonic() < deadline:
        state = a.check_xfer_state(handle) if state == "PROC" else state
        notifs = notifs or b.get_new_notifs()
    assert state == "DONE" and notifs == {a.agent_name: [b"note"]}
    if op == "WRITE":
        assert np.array_equal(dst[1024:2048], src[:1024]) and np.array_equal(
            dst[3072:], src[2048:3072]
        )
        assert not dst[:1024].any() and not dst[2048:3072].any()
    else:
        assert np.array_equal(dst[:1024], src[1024:2048]) and np.array_equal(
            dst[2048:3072], src[3072:]
        )
    a.release_xfer_handle(handle)
    with pytest.raises(NotFoundError):
        a.check_xfer_state(handle)


def test_nixl_errors_become_fabric_errors_naming_the_agent(
    pair: tuple[NixlFabric, NixlFabric],
) -> None:
    """NIXL's own exception types reach callers as kvfsm's kinds, the cause kept."""
    a, _ = pair
    with pytest.raises(NotFoundError, match=f"^{a.agent_name}: nixlNotFoundError") as lost:
        a.send_notif("nobody-loaded", b"x")  # no such peer
    assert type(lost.value.__cause__).__name__ == "nixlNotFoundError"
    buf = np.zeros(4096, dtype=np.uint8)
    a.register_memory(buf)
    local = a.prep_xfer_dlist(None, _rows(buf, 4, 1024))
    with pytest.raises(FabricError, match=f"^{a.agent_name}: nixlInvalidParamError") as bad:
        a.make_prepped_xfer("WRITE", local, np.array([0]), local, np.array([1]), b"")
    assert not isinstance(bad.value, NotFoundError)  # an unmapped NIXL error stays plain


def test_close_releases_everything(pair: tuple[NixlFabric, NixlFabric]) -> None:
    a, b = pair
    buf = np.zeros(1024, dtype=np.uint8)
    a.register_memory(buf)
    a.add_remote_agent(b.get_agent_metadata())
    a.prep_xfer_dlist(None, _rows(buf, 1, 1024))
    assert a.open_resources() == {"memory": 1, "dlists": 1, "xfers": 0, "remote_agents": 1}
    a.close()
    assert a.open_resources() == {"memory": 0, "dlists": 0, "xfers": 0, "remote_agents": 0}


def test_register_refuses_what_is_not_a_byte_buffer(pair: tuple[NixlFabric, NixlFabric]) -> None:
    with pytest.raises(TypeError):
        pair[0].register_memory(np.zeros((2, 2), dtype=np.uint8))


@pytest.mark.parametrize("coalesce", [False, True])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_engines_move_verified_kv_over_real_nixl(mode: Mode, coalesce: bool) -> None:
    """P and D engines, real agents, a handshake through the directory, 20 requests; every byte
    D reports received holds what P's prefill wrote (into D's per-layer torch tensors); every
    request ends with a trace of its bytes and descriptors, NIXL's telemetry included. With
    `coalesce`, the engine posts one row per run of adjacent blocks (NIXL's dynamic lists)."""
    n = next(_names)
    directory = LocalDirectory(time.monotonic)
    geometry = KvGeometry(
        num_layers=2, num_kv_heads=2, head_dim=64, dtype_bytes=2, block_size=4, num_blocks=64
    )
    engines = {}
    # P's cache is one numpy buffer; D's is one torch CPU tensor per layer, as a serving engine's.
    d_layers = [torch.zeros(geometry.region_bytes, dtype=torch.uint8) for _ in range(2)]
    caches = {"P": KvCache.allocate(geometry), "D": KvCache(geometry, d_layers)}
    for side in (Producer(Identity(f"P{n}"), mode), Consumer(Identity(f"D{n}"), mode)):
        fabric = NixlFabric(side.identity.agent)
        engine = Engine(
            side, fabric, caches[side.side], directory.view(), time.monotonic, coalesce=coalesce
        )
        directory.publish(engine.agent, engine.info)
        engines[side.side] = engine
    p, d = engines["P"], engines["D"]
    rng = np.random.default_rng(0)
    finished: dict[str, str] = {}
    traces: dict[str, RequestTrace] = {}
    checks: dict[str, PatternCheck] = {}
    try:
        for i in range(20):
            blocks = rng.choice(64, size=int(rng.integers(1, 4)), replace=False).astype(np.int32)
            write_request(p.kv, request_seed(f"r{i}"), blocks, unit_tokens=4)
            pid, did = f"r{i}-0000000a", f"r{i}-0000000b"
            p.submit(Admit(pid, blocks))
            p.submit(PrefillFinished(pid, blocks))
            d.submit(Admit(did, blocks, f"P{n}", 1, pid if mode == "pull" else ""))
            deadline = time.monotonic() + _TIMEOUT
            while (pid not in finished or did not in finished) and time.monotonic() < deadline:
                for engine in (p, d):
                    engine.poll()
                    for out in engine.take_outputs():
                        if isinstance(out, Finished):
                            finished[out.request_id] = out.state
                        elif isinstance(out, RequestTrace):
                            traces[out.request_id] = out
                        elif isinstance(out, ReportReceived):
                            checks[out.request_id] = check_request(
                                d.kv,
                                request_seed(f"r{i}"),
                                out.blocks,
                                unit_tokens=4,
                                first_token=0,
                                tokens=4 * len(blocks),
                            )
            assert finished.get(pid) == "done" and finished.get(did) == "done", (i, finished)
            assert checks[did] == (len(blocks) * d.kv.block_bytes, 0)
            poster = traces[pid] if mode == "push" else traces[did]
            stats = poster.stats
            assert stats.transfers == 1 and stats.bytes == len(blocks) * p.kv.block_bytes
            runs = 1 + int(np.count_nonzero(np.diff(blocks) != 1))  # same ids on both sides
            # One row per block per layer, or per run of adjacent blocks per layer (coalesced).
            assert stats.descriptors == 2 * (runs if coalesce else len(blocks))
            assert 1 <= stats.fabric_descriptors <= stats.descriptors and stats.xfer_us >= 0
            assert set(poster.time_in_state_s) >= {"allocated"}
        assert not p.side.requests and not d.side.requests
        assert not p.inflight and not d.inflight
    finally:
        for engine in (p, d):
            engine.close()
            engine.fabric.close()
