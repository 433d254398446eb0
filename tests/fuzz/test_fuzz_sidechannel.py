"""The side channel's decoders and a real `HandshakeListener` on a loopback ZMQ socket against
hostile input. Decoders return a frame that re-encodes to itself or raise `SidechannelError`.
The listener answers every message it is sent (garbage, wrong frame counts, mutated and
mismatched requests, oversized frames), counts each under exactly the outcome its contract
names, keeps its thread alive, and still answers a valid request right after."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.sidechannel import (
    HandshakeAccepted,
    HandshakeListener,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    SidechannelError,
    decode_reply,
    decode_request,
    encode,
)
from tests.fuzz.handshake_peers import (
    BOOM,
    HASH,
    HOST,
    PAYLOADS,
    SAFETY_S,
    WIRE,
    expected_outcome,
    frame_lists,
    lookup,
    request,
    request_frames,
)
from tests.fuzz.strategies import (
    as_tree,
    floats,
    msgpack_values,
    mutated_bytes,
    mutated_trees,
    texts,
)

# --- decoders --------------------------------------------------------------------------------------


def check_request(frame: bytes) -> HandshakeRequest | None:
    """Decode a request frame: one with an agent that re-encodes to itself, or a refusal."""
    try:
        got = decode_request(frame)
    except SidechannelError:
        return None
    assert isinstance(got, HandshakeRequest) and got.agent
    assert decode_request(encode(got)) == got
    return got


def check_reply(frame: bytes) -> HandshakeReply | None:
    """Decode a reply frame: a reply with finite clocks that re-encodes to itself, or a
    refusal."""
    try:
        got = decode_reply(frame)
    except SidechannelError:
        return None
    assert isinstance(got, HandshakeAccepted | HandshakeRefused)
    if isinstance(got, HandshakeAccepted):
        assert abs(got.received) <= 1e15 and abs(got.sent) <= 1e15  # NaN fails both
    assert decode_reply(encode(got)) == got
    return got


ACCEPTED = HandshakeAccepted(PAYLOADS["prefill#0"], 12.5, 12.75)
REPLY_TREES = [as_tree(ACCEPTED), as_tree(HandshakeRefused("no"))]
# Leaves a lying listener would use: NaN and huge clocks, agent-like names, long lists.
reply_leaves = st.one_of(
    msgpack_values, floats, st.lists(st.integers(0, 2**64 - 1), min_size=1000, max_size=1000)
)


@given(st.one_of(request_frames, st.binary(max_size=128)))
def test_request_decoder(frame: bytes) -> None:
    check_request(frame)


@given(
    st.sampled_from([as_tree(HandshakeRequest(agent="a#0", wire_version=1, compat_hash="h"))])
    .flatmap(lambda tree: mutated_trees(tree, msgpack_values))
    .map(lambda tree: b"kvhs1" + msgspec.msgpack.encode(tree))
)
def test_request_decoder_on_lying_structures(frame: bytes) -> None:
    check_request(frame)


@given(st.sampled_from(REPLY_TREES).flatmap(lambda tree: mutated_trees(tree, reply_leaves)))
def test_reply_decoder_on_lying_structures(tree: Any) -> None:
    # Wrong types anywhere in the payload and its geometry, NaN clocks, huge lists, extra and
    # missing fields, the other reply's tag.
    check_reply(b"kvhs1" + msgspec.msgpack.encode(tree))


@settings(max_examples=200)
@given(st.sampled_from([encode(ACCEPTED), encode(HandshakeRefused("no"))]).flatmap(mutated_bytes))
def test_reply_decoder_on_mutated_bytes(frame: bytes) -> None:
    check_reply(frame)


@pytest.mark.parametrize("clock", [float("nan"), float("inf"), -float("inf"), 1e300, -1e16])
@pytest.mark.parametrize("field", ["received", "sent"])
def test_non_finite_or_absurd_clocks_are_refused(field: str, clock: float) -> None:
    tree = as_tree(ACCEPTED) | {field: clock}
    with pytest.raises(SidechannelError, match="malformed reply"):
        decode_reply(b"kvhs1" + msgspec.msgpack.encode(tree))


@pytest.mark.parametrize(
    "frame",
    [
        b"kvhs1" + b"\x91" * 200_000 + b"\xc0",  # nesting far deeper than the stack
        b"kvhs1" + b"\x81\xa1x" * 100_000 + b"\xc0",
        b"kvhs1\xdd\xff\xff\xff\xff",  # an array claiming 4G entries
        b"kvhs1\x82\xa1k\xa2no\xa6reason\xdb\xff\xff\xff\xff",  # a 4 GiB reason
    ],
    ids=["arrays", "maps", "array32", "str32"],
)
def test_hostile_shapes_are_malformed(frame: bytes) -> None:
    assert check_reply(frame) is None and check_request(frame) is None


# --- a real listener -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def listener() -> Iterator[HandshakeListener]:
    with HandshakeListener(lookup) as served:
        yield served


@pytest.fixture(scope="module")
def dealer(listener: HandshakeListener) -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{HOST}:{listener.port}")
    yield sock
    sock.close()


def exchange(sock: zmq.Socket[bytes], frames: list[bytes]) -> HandshakeReply:
    """Send `frames` as one message; the listener's answer, decoded."""
    sock.send_multipart(frames)
    assert sock.poll(int(SAFETY_S * 1000)), "the listener did not answer"
    return decode_reply(sock.recv_multipart()[-1])


@given(frames=frame_lists())
def test_listener_counts_every_message_and_keeps_serving(
    listener: HandshakeListener, dealer: zmq.Socket[bytes], frames: list[bytes]
) -> None:
    before = Counter(listener.counters)
    reply = exchange(dealer, frames)
    outcome = expected_outcome(frames)
    # Counted once, under the outcome the listener's contract names (the count comes before
    # the answer, so it is visible now).
    assert Counter(listener.counters) - before == Counter({outcome: 1})
    if outcome == "accepted":
        assert isinstance(reply, HandshakeAccepted)
        assert reply.payload == PAYLOADS[reply.payload.agent]
    else:
        assert isinstance(reply, HandshakeRefused) and reply.reason
        if outcome == "errors":
            assert "lookup exploded" in reply.reason
    # The thread survived and the next peer is served.
    again = exchange(dealer, [request("prefill#1")])
    assert isinstance(again, HandshakeAccepted) and again.payload == PAYLOADS["prefill#1"]
    assert listener.thread.is_alive()


@settings(max_examples=100)
@given(agent=texts, version=st.integers(-(2**63), 2**63 - 1), hash_=texts)
def test_listener_refuses_what_it_does_not_serve(
    listener: HandshakeListener, dealer: zmq.Socket[bytes], agent: str, version: int, hash_: str
) -> None:
    # Well-formed requests for anything: only the served agents with our version and hash
    # are accepted, and a refusal says what was wrong.
    reply = exchange(dealer, [request(agent, version, hash_)])
    served = agent in PAYLOADS and (version, hash_) == (WIRE, HASH)
    assert isinstance(reply, HandshakeAccepted) == served
    if isinstance(reply, HandshakeRefused):
        assert any(
            text in reply.reason
            for text in ("no agent", "mismatch", "empty agent", "lookup exploded")
        ), reply.reason
        assert agent == BOOM or "lookup exploded" not in reply.reason
