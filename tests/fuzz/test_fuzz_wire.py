"""The notification codec against hostile input, beyond tests/wire/test_wire.py: well-formed
messages of every type with bogus field values, byte-level and structural mutations of their
encodings (wrong types, missing and extra fields, NaN, huge integers), and length headers that
claim gigabytes. `decode` returns a message that re-encodes to what it decoded, or raises
`WireError`: never another exception, and never more memory than its input bounds. Sealed
notifications open only untouched, and the replay guard never takes one twice."""

from __future__ import annotations

import tracemalloc
from typing import Any, cast

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.wire import (
    MAX_MESSAGE_BYTES,
    AuthError,
    Grant,
    Heartbeat,
    Message,
    Registration,
    ReplayGuard,
    SharedSecret,
    WireError,
    decode,
    encode,
)
from tests.fuzz.strategies import (
    as_tree,
    msgpack_values,
    mutated_bytes,
    mutated_trees,
    wire_messages,
)

TYPES = Message.__args__


def check_decode(payload: bytes) -> Message | None:
    """Decode `payload`: a message that is possible and re-encodes exactly, or `WireError`."""
    try:
        message = decode(payload)
    except WireError:
        return None
    assert isinstance(message, TYPES)
    message = cast(Message, message)
    assert message.rank >= 0
    if not isinstance(message, Heartbeat):
        assert message.tp_size >= 1
    if isinstance(message, Registration | Grant):
        assert len(message.block_ids) % 4 == 0
    # Bytes, not ==: a NaN deadline decodes faithfully but is not equal to itself.
    assert encode(decode(encode(message))) == encode(message)
    return message


def _impossible(message: Message) -> bool:
    """What the codec refuses after msgspec accepted the types (see `decode`)."""
    if message.rank < 0:
        return True
    if not isinstance(message, Heartbeat) and message.tp_size < 1:
        return True
    return isinstance(message, Registration | Grant) and len(message.block_ids) % 4 != 0


@given(wire_messages())
def test_bogus_values_decode_exactly_or_are_refused(message: Message) -> None:
    payload = encode(message)
    # The structural mutations below start from exactly what travels.
    assert b"kv1" + msgspec.msgpack.encode(as_tree(message)) == payload
    got = check_decode(payload)
    # Refused exactly when impossible; otherwise decoded to the very message sent.
    assert (got is None) == _impossible(message)
    if got is not None:
        assert encode(got) == payload


@given(wire_messages().map(encode).flatmap(mutated_bytes))
def test_mutated_encodings(payload: bytes) -> None:
    check_decode(payload)


@given(wire_messages().map(as_tree).flatmap(lambda t: mutated_trees(t, msgpack_values)))
def test_structurally_mutated_messages(tree: Any) -> None:
    # Wrong types, missing and unknown fields, tags of other messages, nested garbage.
    check_decode(b"kv1" + msgspec.msgpack.encode(tree))


@settings(max_examples=200)
@given(msgpack_values)
def test_any_msgpack_body(value: Any) -> None:
    check_decode(b"kv1" + msgspec.msgpack.encode(value))


_HB = b"\x83\xa1k\xa2hb\xa4rank\x00\xabrequest_ids"  # {"k": "hb", "rank": 0, "request_ids": ...
HOSTILE = {
    "array32 of 4G": b"kv1\xdd\xff\xff\xff\xff",
    "map32 of 4G": b"kv1\xdf\xff\xff\xff\xff",
    "str32 of 4G in a field": b"kv1\x81\xa1k\xdb\xff\xff\xff\xff",
    "bin32 of 4G": b"kv1\xc6\xff\xff\xff\xff",
    "heartbeat ids claiming 268M": b"kv1" + _HB + b"\xdd\x0f\xff\xff\xff",
    "ext type": b"kv1\xc7\x05\x01abcde",
    "nested arrays 200k deep": b"kv1" + b"\x91" * 200_000 + b"\xc0",
    "nested maps 100k deep": b"kv1" + b"\x81\xa1x" * 100_000 + b"\xc0",
    "nesting inside a field": b"kv1" + _HB + b"\x91" * 100_000 + b"\xc0",
    "float as rank": b"kv1\x83\xa1k\xa2hb\xa4rank\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00"
    b"\xabrequest_ids\x90",
    "uint64 max rank": b"kv1\x83\xa1k\xa2hb\xa4rank\xcf" + b"\xff" * 8 + b"\xabrequest_ids\x90",
    "duplicate keys": b"kv1\x84\xa1k\xa2hb\xa4rank\x00\xa4rank\x01\xabrequest_ids\x90",
    "one byte too many": b"kv1" + b"\x00" * MAX_MESSAGE_BYTES,
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_shapes_cost_no_more_than_their_size(case: str) -> None:
    payload = HOSTILE[case]
    tracemalloc.start()
    try:
        got = check_decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A length header is never trusted for an allocation: the decoder never holds more than a
    # few times the payload (nesting costs a frame per level), whatever the headers claim.
    assert peak < 16 * len(payload) + (1 << 20), f"{case}: peak {peak} bytes"
    if case == "uint64 max rank":  # a valid, if absurd, rank: decoded exactly
        assert isinstance(got, Heartbeat) and got.rank == 2**64 - 1
    elif case == "duplicate keys":  # msgpack allows it; the last one wins, consistently
        assert got is None or got.rank in (0, 1)
    else:
        assert got is None, case


@settings(max_examples=50)
@given(st.integers(0, 10_000), st.sampled_from([b"\xa0", b"\xa1x", b"\xa8abcdefgh"]))
def test_huge_heartbeat_lists_are_bounded_by_the_size_limit(n: int, item: bytes) -> None:
    # The most ids a notification can carry is what fits in MAX_MESSAGE_BYTES.
    count = n * 100
    body = _HB + b"\xdd" + count.to_bytes(4, "big") + item * count
    got = check_decode(b"kv1" + body)
    if 3 + len(body) > MAX_MESSAGE_BYTES:
        assert got is None
    else:
        assert isinstance(got, Heartbeat) and len(got.request_ids) == count


_SECRET = SharedSecret(b"a-fuzzing-secret-of-32-bytes....")


@given(st.binary(max_size=256), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.data())
def test_a_sealed_notification_opens_only_untouched(
    payload: bytes, epoch: int, seq: int, data: st.DataObject
) -> None:
    """Any change to a sealed notification (its number, tag or message) is refused; untouched,
    it opens to exactly what was sealed, with its number."""
    sealed = _SECRET.seal("D#0", "P#0", payload, epoch, seq)
    assert _SECRET.open("D#0", "P#0", sealed) == (epoch, seq, payload)
    mutated = data.draw(mutated_bytes(sealed))
    if mutated != sealed:
        with pytest.raises(AuthError):
            _SECRET.open("D#0", "P#0", mutated)


@given(
    st.lists(
        st.tuples(st.sampled_from(["D#0", "D#1"]), st.integers(0, 3), st.integers(1, 150)),
        max_size=300,
    )
)
def test_the_replay_guard_never_takes_a_notification_twice(
    heard: list[tuple[str, int, int]],
) -> None:
    """Against a reference: nothing is taken twice or from an earlier incarnation than one
    taken; whatever is newer than everything taken from its sender is taken."""
    guard = ReplayGuard()
    taken: set[tuple[str, int, int]] = set()
    newest: dict[str, tuple[int, int]] = {}
    for sender, epoch, seq in heard:
        ok = guard.check(sender, epoch, seq) is None
        if ok:
            assert (sender, epoch, seq) not in taken
            assert sender not in newest or epoch >= newest[sender][0]
            taken.add((sender, epoch, seq))
        if sender not in newest or (epoch, seq) > newest[sender]:
            assert ok
            newest[sender] = (epoch, seq)
