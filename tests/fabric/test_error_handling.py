"""UCX's error handling mode (`ucx_error_handling`): both modes move bytes and notifications,
the setting reaches NIXL, a wrong value is refused, and with error handling off a request whose
peer process was killed still ends, failed, by kvfsm's own deadlines."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvfsm.core import CoreConfig
from kvfsm.fabric import (
    UCX_ERROR_HANDLING_DEFAULT,
    UCX_ERROR_HANDLING_MODES,
    NixlFabric,
    UcxErrorHandling,
)
from kvfsm.harness import RankProcesses, RankSpec
from kvfsm.layout import DTYPES, model_geometry
from kvfsm.sidechannel import compat_hash
from kvfsm.wire import WIRE_VERSION

pytestmark = pytest.mark.nixl

_BOUND_S = 60.0  # a hang bound, not a timing expectation
_names = itertools.count()
_SMALL = CoreConfig(
    lease_s=2.0,
    watchdog_s=1.0,
    stall_s=0.5,
    producer_stall_s=1.0,
    fence_s=1.0,
    heartbeat_s=0.2,
    pending_registration_ttl_s=2.0,
)


@pytest.fixture(params=UCX_ERROR_HANDLING_MODES)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[NixlFabric, NixlFabric]]:
    n, mode = next(_names), request.param
    a = NixlFabric(f"ehA{n}", ucx_error_handling=mode)
    b = NixlFabric(f"ehB{n}", ucx_error_handling=mode)
    yield a, b
    a.close()
    b.close()


def _row(buf: np.ndarray) -> np.ndarray:
    return np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.int64)


def _notifs(fabric: NixlFabric, sender: NixlFabric) -> list[bytes]:
    """Poll both agents until a notification from `sender` arrives at `fabric`."""
    deadline = time.monotonic() + _BOUND_S
    while time.monotonic() < deadline:
        got = fabric.get_new_notifs().get(sender.agent_name)
        if got:
            return got
        sender.get_new_notifs()
    raise TimeoutError(f"no notification from {sender} in {_BOUND_S}s")


def test_both_modes_move_verified_bytes_with_notifications(
    pair: tuple[NixlFabric, NixlFabric],
) -> None:
    a, b = pair
    src = np.random.default_rng(0).integers(0, 256, 16384, dtype=np.uint8)
    dst = np.zeros_like(src)
    a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    idx = np.zeros(1, dtype=np.int64)
    for i in range(3):  # a few: the first one also wires the connection up
        src[:] = np.roll(src, 1)
        local = a.prep_xfer_dlist(None, _row(src))
        remote = a.prep_xfer_dlist(b.agent_name, _row(dst))
        handle = a.make_prepped_xfer("WRITE", local, idx, remote, idx, b"w%d" % i)
        state, got = a.transfer(handle), list[bytes]()
        deadline = time.monotonic() + _BOUND_S
        while (state == "PROC" or not got) and time.monotonic() < deadline:
            # Both agents progress: UCX wires a connection up only as both sides poll.
            state = a.check_xfer_state(handle) if state == "PROC" else state
            got = got or b.get_new_notifs().get(a.agent_name, [])
        assert state == "DONE" and got == [b"w%d" % i]
        assert np.array_equal(dst, src)
        b.send_notif(a.agent_name, b"ack%d" % i)
        assert _notifs(a, b) == [b"ack%d" % i]
        a.release_xfer_handle(handle)
        a.release_dlist_handle(local)
        a.release_dlist_handle(remote)


def test_the_setting_reaches_the_agent(pair: tuple[NixlFabric, NixlFabric]) -> None:
    a, b = pair
    assert a.ucx_error_handling == b.ucx_error_handling
    assert a.ucx_error_handling in UCX_ERROR_HANDLING_MODES


@pytest.mark.parametrize("mode", UCX_ERROR_HANDLING_MODES)
def test_nixl_reports_the_mode_it_was_given(mode: UcxErrorHandling) -> None:
    fabric = NixlFabric(f"ehM{next(_names)}", ucx_error_handling=mode)
    try:
        assert fabric.ucx_error_handling == mode
    finally:
        fabric.close()


def test_a_wrong_value_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match=r"ucx_error_handling must be one of .*'bogus'"):
        NixlFabric("ehX#0", ucx_error_handling="bogus")  # type: ignore[arg-type]


# Importing the connector imports vLLM, whose import chain warns once (see tests/vllm_connector/conftest.py).
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_connector_setting_is_checked() -> None:
    pytest.importorskip("vllm")
    from kvfsm.vllm._settings import KvfsmSettings, SettingsError

    assert KvfsmSettings.from_extra_config({}).ucx_error_handling == UCX_ERROR_HANDLING_DEFAULT
    with pytest.raises(SettingsError, match="ucx_error_handling"):
        KvfsmSettings.from_extra_config({"ucx_error_handling": "bogus"})
    assert KvfsmSettings.from_extra_config({"ucx_error_handling": "none"}).ucx_error_handling == (
        "none"
    )


# --- a killed peer, with real rank processes -----------------------------------------------------


def _spawn(mode: UcxErrorHandling) -> RankProcesses:
    """A P and a D rank process, pull mode, short deadlines, connected."""
    g = model_geometry("tiny", tp_size=1, block_size=16, memory_mib=4)
    chash = compat_hash(
        wire_version=WIRE_VERSION, mode="pull", model="tiny", dtype=DTYPES["tiny"], geometry=g
    )
    ranks = RankProcesses()
    for side in ("P", "D"):
        ranks.start(
            RankSpec(
                side, "pull", g.for_rank(0), 1, 16, chash, ucx_error_handling=mode, config=_SMALL
            )
        )
    ranks.connect(ranks.await_ready())
    return ranks


def _until(conn: Connection, kind: str) -> tuple[Any, ...]:
    """The rank's next message of `kind` (others are skipped; an error fails the test)."""
    deadline = time.monotonic() + _BOUND_S
    while conn.poll(max(0.0, deadline - time.monotonic())):
        msg: tuple[Any, ...] = conn.recv()
        assert msg[0] != "error", msg
        if msg[0] == kind:
            return msg
    raise TimeoutError(f"no {kind!r} from the rank in {_BOUND_S}s")


@pytest.mark.parametrize("mode", UCX_ERROR_HANDLING_MODES)
def test_a_killed_peer_fails_the_request_in_either_mode(mode: UcxErrorHandling) -> None:
    """With "none", nothing in UCX tells D that P died (its notifications to P still succeed):
    D's watchdog ends the request; with "peer", UCX may tell D first. Either way D reports the
    load failed, with its blocks."""
    ranks = _spawn(mode)
    p, d = ranks.pipes["P#0"], ranks.pipes["D#0"]
    try:
        blocks = np.array([1, 2], dtype=np.int32)
        p.send(("admit_p", "k1", "p1", blocks, False))
        d.send(("admit_d", "k1", "d1", blocks, "p1", 32))
        received = _until(d, "received")
        assert received[1] == "d1" and received[2] > 0 and received[3] == 0  # bytes checked
        ranks.kill("P#0", _BOUND_S)
        d.send(("admit_d", "k2", "d2", np.array([3, 4], dtype=np.int32), "p2", 32))
        assert _until(d, "failed")[1] == "d2"
        finished = _until(d, "finished")
        while finished[1] != "d2":
            finished = _until(d, "finished")
        # "none": only D's watchdog can end it; "peer": UCX's error may end it first.
        assert finished[2] == "expired" if mode == "none" else finished[2] in ("failed", "expired")
    finally:
        ranks.stop()
