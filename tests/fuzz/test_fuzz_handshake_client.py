"""`fetch_peer` against a hostile listener: a real ZMQ ROUTER on loopback answering every request
with garbage, truncated or mutated replies, the wrong message type, NaN clocks, huge lists, deep
nesting, oversized frames, extra frames, or well-formed payloads that lie (another agent, engine,
rank, version or hash), or not answering at all. The client raises `HandshakeError` naming the
listener, never another exception, and never waits past its timeout; what it accepts is the
agent it asked for and passes or fails `validate` with `HandshakeError` too."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.runtime import HandshakeError
from kvfsm.sidechannel import (
    MAX_HANDSHAKE_BYTES,
    HandshakeAccepted,
    HandshakePayload,
    HandshakeRefused,
    HandshakeRequest,
    encode,
    fetch_peer,
    validate,
)
from kvfsm.wire import Completion, SharedSecret
from kvfsm.wire import encode as wire_encode
from tests.fuzz.handshake_peers import HASH, HOST, PAYLOADS, SAFETY_S, WIRE
from tests.fuzz.strategies import (
    as_tree,
    floats,
    msgpack_values,
    mutated_bytes,
    mutated_trees,
    texts,
)

AGENT = "prefill#0"
GOOD = PAYLOADS[AGENT]


class HostileListener:
    """A ROUTER answering each request with `frames` (after the envelope; with the REQ
    delimiter unless `delimiter` is False), or not at all when `frames` is None."""

    def __init__(self) -> None:
        self.frames: list[bytes] | None = None
        self.delimiter = True
        self.requests = 0
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port: int = self._sock.bind_to_random_port(f"tcp://{HOST}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, *_ = self._sock.recv_multipart()
            self.requests += 1
            if self.frames is not None:
                envelope = [identity, b""] if self.delimiter else [identity]
                self._sock.send_multipart([*envelope, *self.frames])

    def close(self) -> None:
        """Stop answering and release the port."""
        self._stop.set()
        self._thread.join()
        self._sock.close()


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileListener]:
    server = HostileListener()
    yield server
    server.close()


def fetch(port: int, timeout_s: float = SAFETY_S) -> tuple[HandshakePayload, float, float]:
    """Ask for `AGENT` as an engine would."""
    return fetch_peer(HOST, port, AGENT, compat_hash=HASH, wire_version=WIRE, timeout_s=timeout_s)


def _lie(**changes: Any) -> bytes:
    return encode(HandshakeAccepted(msgspec.structs.replace(GOOD, **changes), 1.0, 1.0))


GOOD_REPLY = encode(HandshakeAccepted(GOOD, 1.0, 1.0))  # held for no time: a possible clock
LIES = [
    _lie(agent="prefill#1"),
    _lie(engine_id="decode"),
    _lie(geometry=GOOD.geometry.for_rank(1)),  # rank 1's geometry under rank 0's name
    _lie(wire_version=WIRE + 1),
    _lie(compat_hash="0" * 64),
    _lie(base_addresses=()),
    _lie(base_addresses=(2**64 - 1,) * 8),
    _lie(block_lens=(1,) * 8),
    _lie(block_lens=tuple(range(100_000))),  # a huge list, within the size limit
    _lie(mode="sideways", device=2**63 - 1),
    encode(HandshakeRefused("go away")),
    encode(HandshakeRequest(agent=AGENT, wire_version=WIRE, compat_hash=HASH)),  # wrong type
    wire_encode(Completion(request_id="r", sender_request_id="s", rank=0, tp_size=1)),
    b"kvhs1" + b"\x91" * 200_000 + b"\xc0",  # nesting
    b"x" * (MAX_HANDSHAKE_BYTES + 1),  # oversized, within ZMQ's hard limit
    b"",
]
reply_leaves = st.one_of(msgpack_values, floats, texts)
replies = st.one_of(
    st.sampled_from(LIES),
    st.binary(max_size=64),
    st.integers(0, len(GOOD_REPLY) - 1).map(lambda n: GOOD_REPLY[:n]),  # truncated
    mutated_bytes(GOOD_REPLY),
    mutated_trees(as_tree(HandshakeAccepted(GOOD, 1.0, 1.0)), reply_leaves).map(
        lambda tree: b"kvhs1" + msgspec.msgpack.encode(tree)
    ),
)
frames = st.one_of(
    replies.map(lambda r: [r]),
    st.lists(replies, min_size=2, max_size=3),  # extra frames: REQ reads the first
)


def _judged(hostile: HostileListener, reply: list[bytes]) -> None:
    """One handshake answered with `reply`: a clear error or the asked agent's payload."""
    hostile.frames = reply
    where = f"{HOST}:{hostile.port}"
    try:
        payload, offset, error = fetch(hostile.port)
    except HandshakeError as exc:
        # The reply was read and judged (not a timeout), and the error names the listener.
        assert "no answer" not in str(exc) and where in str(exc), str(exc)
        return
    # Accepted only what was asked for, with a usable clock estimate.
    assert (payload.agent, payload.engine_id, payload.rank) == (AGENT, "prefill", 0)
    assert (payload.wire_version, payload.compat_hash) == (WIRE, HASH)
    assert math.isfinite(offset) and math.isfinite(error) and error >= 0
    try:  # as `ZmqDirectory` does next: geometry problems are handshake errors too
        validate(payload, expect_mode="push")
    except HandshakeError:
        return
    assert payload.layout().geometry == payload.geometry


@given(reply=frames)
def test_client_judges_whatever_the_listener_says(
    hostile: HostileListener, reply: list[bytes]
) -> None:
    _judged(hostile, reply)


@pytest.mark.parametrize("index", range(len(LIES)))
def test_each_lie_is_a_handshake_error(hostile: HostileListener, index: int) -> None:
    # As a directory of a push engine takes a handshake: the client's checks, then validate's.
    hostile.frames = [LIES[index]]
    with pytest.raises(HandshakeError, match=rf"{HOST}:{hostile.port}|from '{AGENT}'"):
        validate(fetch(hostile.port)[0], expect_mode="push")


def test_the_honest_reply_is_accepted(hostile: HostileListener) -> None:
    # The hostile listener answering honestly: proves the cases above fail for their lie.
    hostile.frames = [GOOD_REPLY]
    assert fetch(hostile.port)[0] == GOOD


@pytest.mark.parametrize(
    ("reply", "delimiter"),
    [
        (None, True),  # silence
        ([GOOD_REPLY], False),  # no REQ delimiter: REQ drops the reply
        ([b"x" * (3 * MAX_HANDSHAKE_BYTES)], True),  # beyond ZMQ_MAXMSGSIZE: connection dropped
    ],
    ids=["silent", "no-delimiter", "beyond-hard-limit"],
)
def test_no_usable_answer_ends_at_the_timeout(
    hostile: HostileListener, reply: list[bytes] | None, delimiter: bool
) -> None:
    hostile.frames, hostile.delimiter = reply, delimiter
    asked = hostile.requests
    start = time.monotonic()
    try:
        with pytest.raises(HandshakeError, match=r"no answer from .* within 0.3s"):
            fetch(hostile.port, timeout_s=0.3)
    finally:
        hostile.delimiter = True
    # Liveness, not performance: the call returned within its timeout plus a generous margin
    # for a loaded machine (it would otherwise block forever).
    assert time.monotonic() - start < 0.3 + SAFETY_S
    assert hostile.requests == asked + 1  # the request did reach the listener


def test_clocks_that_contradict_the_round_trip_are_refused(hostile: HostileListener) -> None:
    hostile.frames = [encode(HandshakeAccepted(GOOD, 0.0, 1e6))]
    with pytest.raises(HandshakeError, match="clock"):
        fetch(hostile.port)


@given(reply=frames)
def test_with_a_secret_nothing_untagged_is_taken_for_the_listeners_word(
    hostile: HostileListener, reply: list[bytes]
) -> None:
    """An asker holding the secret takes no acceptance and no refusal that is not tagged for
    its request: whatever else answers is an unauthenticated reply, saying so."""
    hostile.frames = reply
    with pytest.raises(HandshakeError) as caught:
        fetch_peer(
            HOST,
            hostile.port,
            AGENT,
            compat_hash=HASH,
            wire_version=WIRE,
            timeout_s=SAFETY_S,
            secret=SharedSecret(b"the-fuzzing-deployment-secret!!"),
        )
    says = str(caught.value)
    assert "no answer" not in says
    # A refusal is read as the listener's word only if tagged: never here.
    assert "refused the handshake" not in says, says
