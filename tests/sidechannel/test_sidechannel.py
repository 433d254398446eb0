"""The ZMQ handshake side channel, over real sockets on 127.0.0.1."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvfsm.layout import KvGeometry
from kvfsm.runtime import HandshakeError, PeerInfo
from kvfsm.sidechannel import (
    MAX_HANDSHAKE_BYTES,
    HandshakeAccepted,
    HandshakeListener,
    HandshakePayload,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    SidechannelError,
    ZmqDirectory,
    compat_hash,
    decode_reply,
    decode_request,
    encode,
    fetch_peer,
    validate,
)
from kvfsm.testing import free_port
from tests.sidechannel.fixtures import GEOMETRY, HASH, HOST, PAYLOADS, SAFETY_S, WIRE, payload


@pytest.fixture
def listener() -> Iterator[HandshakeListener]:
    with HandshakeListener(PAYLOADS.get) as served:
        yield served


def _fetch(port: int, agent: str = "prefill#0", **kw: object) -> HandshakePayload:
    args: dict[str, object] = {"compat_hash": HASH, "wire_version": WIRE, "timeout_s": SAFETY_S}
    args.update(kw)
    return fetch_peer(HOST, port, agent, **args)[0]  # type: ignore[arg-type]


def _raw_request(port: int, frames: list[bytes]) -> HandshakeReply:
    """Send raw frames from a DEALER (no REQ framing rules) and decode the reply."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{port}")
        sock.send_multipart(frames)
        assert sock.poll(int(SAFETY_S * 1000)), "the listener did not answer"
        return decode_reply(sock.recv_multipart()[-1])
    finally:
        sock.close()


@contextmanager
def _raw_server(reply: bytes) -> Iterator[int]:
    """A ROUTER that answers every request with `reply`; yields its port."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(20):
                frames = sock.recv_multipart()
                sock.send_multipart([*frames[:-1], reply])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join()
        sock.close()


# --- payload codec -------------------------------------------------------------------------------


def test_codec_round_trips_and_rejects_garbage() -> None:
    request = HandshakeRequest("prefill#0", WIRE, HASH)
    assert decode_request(encode(request)) == request
    for reply in (HandshakeAccepted(payload(), 1.0, 1.5), HandshakeRefused("no")):
        assert decode_reply(encode(reply)) == reply
    with pytest.raises(SidechannelError, match="not a kvfsm handshake frame"):
        decode_request(b"GET / HTTP/1.1")
    with pytest.raises(SidechannelError, match="malformed reply"):
        decode_reply(encode(request))
    with pytest.raises(SidechannelError, match="exceeds"):
        decode_request(b"x" * (MAX_HANDSHAKE_BYTES + 1))
    with pytest.raises(SidechannelError, match="empty agent"):
        decode_request(encode(HandshakeRequest("", WIRE, HASH)))


def test_compat_hash_is_stable_and_covers_what_must_be_equal() -> None:
    fields: dict[str, object] = {
        "wire_version": WIRE,
        "mode": "push",
        "model": "llama-3-8b",
        "dtype": "bfloat16",
        "geometry": GEOMETRY,
    }
    assert compat_hash(**fields) == HASH and len(HASH) == 64  # type: ignore[arg-type]
    changed: dict[str, object] = {"wire_version": 2, "mode": "pull", "model": "m", "dtype": "f16"}
    for name, value in {
        "num_layers": 33,
        "num_kv_heads": 4,
        "head_dim": 64,
        "dtype_bytes": 4,
        "kv_layout": "NHD",
    }.items():
        changed[name] = msgspec.structs.replace(GEOMETRY, **{name: value})
    changed["mla"] = msgspec.structs.replace(GEOMETRY, mla=True, num_kv_heads=1)
    hashes = {
        compat_hash(**(fields | ({"geometry": v} if isinstance(v, KvGeometry) else {k: v})))  # type: ignore[arg-type]
        for k, v in changed.items()
    }
    assert len(hashes) == len(changed) and HASH not in hashes
    # What may differ between the two sides does not change it.
    for same in ({"tp_size": 4}, {"block_size": 32}, {"num_blocks": 7}, {"split_kv": True}):
        geometry = msgspec.structs.replace(GEOMETRY, **same)
        assert compat_hash(**(fields | {"geometry": geometry})) == HASH  # type: ignore[arg-type]


# --- client and listener -------------------------------------------------------------------------


def test_handshake_returns_thepayload(listener: HandshakeListener) -> None:
    assert _fetch(listener.port, "prefill#1") == PAYLOADS["prefill#1"]
    assert listener.counters == {"accepted": 1}


def test_nothing_listening_is_a_handshake_error() -> None:
    port = free_port(HOST)
    with pytest.raises(HandshakeError, match=rf"no answer from {HOST}:{port} within 0.3s"):
        _fetch(port, timeout_s=0.3)


def test_unknown_agent_is_refused(listener: HandshakeListener) -> None:
    with pytest.raises(HandshakeError, match=r"refused .*no agent 'decode#0'"):
        _fetch(listener.port, "decode#0")
    assert listener.counters == {"refused": 1}


def test_hash_mismatch_is_refused_naming_both_hashes(listener: HandshakeListener) -> None:
    other = "ab" * 32
    with pytest.raises(HandshakeError, match="compat hash mismatch") as info:
        _fetch(listener.port, compat_hash=other)
    assert other in str(info.value) and HASH in str(info.value)
    assert "HND pages" in str(info.value)  # what the listener runs, so the asker can compare
    assert listener.counters == {"refused": 1}


def test_wire_version_mismatch_is_refused(listener: HandshakeListener) -> None:
    with pytest.raises(HandshakeError, match="wire version mismatch: you speak 7"):
        _fetch(listener.port, wire_version=7)


@pytest.mark.parametrize(
    ("served", "match"),
    [
        (payload("other"), "engine id mismatch: asked for 'prefill', got 'other'"),
        (payload(rank=1), "agent mismatch: asked for 'prefill#0', got 'prefill#1'"),
        (payload(rank=1, agent="prefill#0"), "inconsistent payload"),
        (payload(compat_hash="cd" * 32, wire_version=2), "wire version mismatch"),
    ],
)
def test_client_checks_what_a_faulty_listener_sends(served: HandshakePayload, match: str) -> None:
    # A listener that ignores the request and skips its own checks: the client must catch it.
    with (
        _raw_server(encode(HandshakeAccepted(served, 1.0, 1.5))) as port,
        pytest.raises(HandshakeError, match=match),
    ):
        _fetch(port)


def test_client_checks_the_hash_of_thepayload() -> None:
    served = payload(compat_hash="cd" * 32)
    with (
        _raw_server(encode(HandshakeAccepted(served, 1.0, 1.5))) as port,
        pytest.raises(HandshakeError, match="compat hash mismatch") as info,
    ):
        _fetch(port)
    assert "cd" * 32 in str(info.value) and HASH in str(info.value)


@pytest.mark.parametrize(
    "reply",
    [b"garbage", b"", encode(HandshakeRequest("x", 1, "h")), encode(HandshakeRefused("x"))[:-2]],
)
def test_undecodable_reply_is_a_handshake_error(reply: bytes) -> None:
    with _raw_server(reply) as port, pytest.raises(HandshakeError, match="undecodable reply"):
        _fetch(port)


@pytest.mark.parametrize(
    ("frames", "outcome", "reason"),
    [
        ([b"garbage"], "malformed", "not a kvfsm handshake frame"),
        ([b"", b"garbage"], "malformed", "not a kvfsm handshake frame"),  # REQ-style framing
        ([encode(HandshakeRefused("x"))], "malformed", "malformed request"),
        ([encode(HandshakeRequest("", 1, "h"))], "malformed", "empty agent"),
        ([b""], "malformed", "0 frames"),
        ([b"a", b"b"], "malformed", "2 frames"),
        ([b"x" * (MAX_HANDSHAKE_BYTES + 1)], "oversized", "oversized request"),
    ],
)
def test_bad_requests_are_refused_and_counted(
    listener: HandshakeListener, frames: list[bytes], outcome: str, reason: str
) -> None:
    reply = _raw_request(listener.port, frames)
    assert isinstance(reply, HandshakeRefused) and reason in reply.reason
    assert listener.counters == {outcome: 1}
    assert _fetch(listener.port) == PAYLOADS["prefill#0"]  # still serving


def test_frames_beyond_the_hard_limit_are_dropped(listener: HandshakeListener) -> None:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{listener.port}")
        sock.send(b"x" * (4 * MAX_HANDSHAKE_BYTES))
        # libzmq on the listener's side drops the connection instead of delivering the frame.
        assert monitor.poll(int(SAFETY_S * 1000)), "the listener kept the connection"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert not sock.poll(0)  # and sent no reply
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
    assert _fetch(listener.port) == PAYLOADS["prefill#0"]
    assert listener.counters == {"accepted": 1}


def test_a_failing_payload_lookup_is_refused_and_the_thread_survives() -> None:
    def lookup(agent: str) -> HandshakePayload | None:
        if agent == "boom#0":
            raise RuntimeError("lookup exploded")
        return PAYLOADS.get(agent)

    with HandshakeListener(lookup) as served:
        with pytest.raises(HandshakeError, match="lookup exploded"):
            _fetch(served.port, "boom#0")
        assert _fetch(served.port) == PAYLOADS["prefill#0"]
        assert served.counters == {"errors": 1, "accepted": 1}
        assert served.thread.is_alive()


def test_port_in_use_is_a_sidechannel_error(listener: HandshakeListener) -> None:
    port = listener.port
    with pytest.raises(SidechannelError, match=rf"{HOST}:{port} is in use.*port=0"):
        HandshakeListener(PAYLOADS.get, port=port)
    assert _fetch(port) == PAYLOADS["prefill#0"]  # the failed bind left the first one alone


def test_close_stops_the_thread_and_frees_the_port() -> None:
    first = HandshakeListener(PAYLOADS.get)
    port = first.port
    first.close()
    first.close()  # idempotent
    assert not first.thread.is_alive()
    with HandshakeListener(PAYLOADS.get, port=port) as again:
        assert again.port == port
        assert _fetch(port) == PAYLOADS["prefill#0"]


def test_many_concurrent_handshakes_succeed(listener: HandshakeListener) -> None:
    agents = [f"prefill#{i % 2}" for i in range(50)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda a: _fetch(listener.port, a), agents))
    assert got == [PAYLOADS[a] for a in agents]
    assert listener.counters == {"accepted": 50}


# --- directory -----------------------------------------------------------------------------------


def _collect(directory: ZmqDirectory, n: int) -> dict[str, PeerInfo | HandshakeError]:
    """Results of `n` handshakes, waiting with the directory's own `wait` (bounded)."""
    out: dict[str, PeerInfo | HandshakeError] = {}
    while len(out) < n:
        assert directory.wait(SAFETY_S), f"only {len(out)} of {n} handshakes finished"
        out.update(directory.results())
    return out


def _info(payload: HandshakePayload) -> PeerInfo:
    return PeerInfo(
        payload.agent, payload.agent_metadata, payload.layout(), incarnation=payload.incarnation
    )


def _sans_clock(result: PeerInfo | HandshakeError) -> PeerInfo | HandshakeError:
    if isinstance(result, HandshakeError):
        return result
    return msgspec.structs.replace(result, clock_offset=0.0, clock_error=0.0)


@pytest.mark.parametrize("skew", [0.0, 3e5, -1234.5])
def test_directory_measures_the_peer_clock_offset(skew: float) -> None:
    """A listener on a host whose monotonic clock started elsewhere: the handshake learns the
    offset, within an error bound that contains the truth."""
    ours = time.monotonic
    with (
        HandshakeListener(PAYLOADS.get, clock=lambda: ours() + skew) as skewed,
        ZmqDirectory({}, compat_hash=HASH, wire_version=WIRE, clock=ours) as directory,
    ):
        directory.start("prefill#0", f"{HOST}:{skewed.port}")
        got = _collect(directory, 1)["prefill#0"]
    assert isinstance(got, PeerInfo)
    assert got.clock_error > 0
    assert abs(got.clock_offset - skew) <= got.clock_error + 1e-6


def test_directory_reports_successes_and_failures(listener: HandshakeListener) -> None:
    dead = free_port(HOST)
    addresses = {
        "prefill#0": (HOST, listener.port),
        "prefill#1": (HOST, listener.port),
        "decode#0": (HOST, listener.port),  # listener does not serve it
        "gone#0": (HOST, dead),
    }
    with ZmqDirectory(addresses, compat_hash=HASH, wire_version=WIRE, timeout_s=0.3) as directory:
        assert directory.results() == []
        assert not directory.wait(0)
        for peer in [*addresses, "unmapped#0"]:
            directory.start(peer)
        got = _collect(directory, 5)
        assert directory.pending == 0 and directory.results() == []
    assert _sans_clock(got["prefill#0"]) == _info(PAYLOADS["prefill#0"])
    assert _sans_clock(got["prefill#1"]) == _info(PAYLOADS["prefill#1"])
    expected = {"decode#0": "no agent", "gone#0": "no answer", "unmapped#0": "no side-channel"}
    for peer, text in expected.items():
        result = got[peer]
        assert isinstance(result, HandshakeError) and text in str(result), (peer, result)


def test_directory_handshakes_at_a_contact_it_is_given(listener: HandshakeListener) -> None:
    # No address book entry for the agent: the contact the core learned is where to go.
    with ZmqDirectory({}, compat_hash=HASH, wire_version=WIRE) as directory:
        directory.start("prefill#1", f"{HOST}:{listener.port}")
        directory.start("prefill#0", "not-an-address")
        got = _collect(directory, 2)
    assert _sans_clock(got["prefill#1"]) == _info(PAYLOADS["prefill#1"])
    assert "no side-channel address for 'prefill#0'" in str(got["prefill#0"])


def test_directory_checks_payloads(listener: HandshakeListener) -> None:
    def resolve(peer: str) -> tuple[str, int]:
        if peer.startswith("prefill"):
            return HOST, listener.port
        raise LookupError(peer)

    check: Callable[[HandshakePayload], None] = functools.partial(validate, expect_mode="pull")
    with ZmqDirectory(resolve, compat_hash=HASH, wire_version=WIRE, check=check) as directory:
        directory.start("prefill#0")
        directory.start("elsewhere#0")
        got = _collect(directory, 2)
    assert "mode mismatch: we run 'pull', peer runs 'push'" in str(got["prefill#0"])
    assert "LookupError" in str(got["elsewhere#0"])


def test_directory_turns_bad_geometry_into_a_result() -> None:
    bad = payload(block_lens=(4096,) * 32)
    with (
        HandshakeListener({bad.agent: bad}.get) as served,
        ZmqDirectory({bad.agent: (HOST, served.port)}, compat_hash=HASH, wire_version=WIRE) as d,
    ):
        d.start(bad.agent)
        (result,) = _collect(d, 1).values()
    assert isinstance(result, HandshakeError) and "block lengths [4096] do not match" in str(result)


def test_directory_after_close_reports_instead_of_raising() -> None:
    directory = ZmqDirectory({}, compat_hash=HASH, wire_version=WIRE)
    directory.close()
    directory.close()
    directory.start("prefill#0")
    ((peer, result),) = directory.results()
    assert peer == "prefill#0" and isinstance(result, HandshakeError)


def test_directory_runs_many_handshakes(listener: HandshakeListener) -> None:
    addresses = {a: (HOST, listener.port) for a in PAYLOADS}
    with ZmqDirectory(addresses, compat_hash=HASH, wire_version=WIRE, max_workers=8) as directory:
        for i in range(50):
            directory.start(f"prefill#{i % 2}")
        results: list[tuple[str, PeerInfo | HandshakeError]] = []
        while len(results) < 50:
            assert directory.wait(SAFETY_S)
            results += directory.results()
    assert all(_sans_clock(info) == _info(PAYLOADS[peer]) for peer, info in results)


# --- validate ------------------------------------------------------------------------------------


def _d(**changes: object) -> KvGeometry:
    """A D rank's geometry: TP 4, blocks of 32 tokens (the payloads are P's: TP 2, 16 tokens)."""
    fields: dict[str, object] = {"tp_size": 4, "block_size": 32, "num_blocks": 99} | changes
    return msgspec.structs.replace(GEOMETRY, **fields)


def test_validate_accepts_compatible_geometry() -> None:
    validate(payload(), expect_mode="push", local=_d(), local_is_p=False)
    validate(payload(rank=1), local=_d(tp_rank=3, split_kv=True))  # K/V split may differ
    validate(payload(), local=GEOMETRY.for_rank(0), local_is_p=True)


def test_validate_lists_every_problem() -> None:
    bad = payload(base_addresses=(0x1000,), mode="pull")
    with pytest.raises(HandshakeError) as info:
        validate(bad, expect_mode="push", local=_d(tp_size=3, num_kv_heads=9))
    text = str(info.value)
    assert "1 base addresses for 32 regions" in text and "mode mismatch" in text
    assert "TP sizes 3 (ours) and 2 (the peer's) do not divide" in text


@pytest.mark.parametrize(
    ("local", "local_is_p", "match"),
    [
        (
            _d(tp_rank=2),
            False,
            r"rank 2/4 exchanges KV with peer ranks \[1\] of 2, not with rank 0",
        ),
        (_d(block_size=8), False, "P's blocks of 16 tokens must divide D's blocks of 8"),
        (_d(head_dim=64), False, "head_dim differs"),
        (_d(kv_layout="NHD"), False, "kv_layout differs"),
        (_d(mla=True, num_kv_heads=1), False, "num_kv_heads differs.*mla differs"),
    ],
)
def test_validate_refuses_geometry_that_cannot_pair(
    local: KvGeometry, local_is_p: bool, match: str
) -> None:
    with pytest.raises(HandshakeError, match=match):
        validate(payload(rank=0), local=local, local_is_p=local_is_p)


def test_validate_refuses_overlapping_regions() -> None:
    bases = (0x10000,) * 32
    with pytest.raises(HandshakeError, match="overlap"):
        validate(payload(base_addresses=bases))
