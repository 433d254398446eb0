"""The wire codec: every message round-trips, anything malformed is a `WireError` (never another
exception), block ids pack as little-endian int32, and request ids lose their per-side suffix."""

from __future__ import annotations

from typing import Any, cast

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.wire import (
    MAX_MESSAGE_BYTES,
    Cancel,
    CancelAck,
    Completion,
    Failure,
    Grant,
    Heartbeat,
    Message,
    Progress,
    Registration,
    WireError,
    base_request_id,
    decode,
    encode,
    pack_blocks,
    unpack_blocks,
)

TYPES = (Registration, Grant, Progress, Completion, Failure, Cancel, CancelAck, Heartbeat)
COMMON: dict[str, Any] = {"request_id": "req-1-0123abcd", "sender_request_id": "req-1-89abcdef"}
COMMON |= {"rank": 3, "tp_size": 8}
BLOCKS = pack_blocks([0, 1, 7, 2**31 - 1])
MESSAGES: list[Message] = [
    Registration(**COMMON, engine_id="engine-é", block_ids=BLOCKS, deadline=1234.5),
    Registration(**COMMON, engine_id="", block_ids=b"", deadline=0.0),
    Grant(**COMMON, block_ids=BLOCKS, deadline=-1.0),
    Progress(**COMMON),
    Completion(**COMMON),
    Failure(**COMMON, reason="peer lost: ☠"),
    Cancel(**COMMON),
    CancelAck(**COMMON),
    Heartbeat(request_ids=["req-1", "req-2-0123abcd"], rank=0),
    Heartbeat(request_ids=[], rank=7),
]
VALID = [encode(m) for m in MESSAGES]


def raw(**fields: Any) -> bytes:
    """A kv1 payload with exactly these msgpack fields, bypassing the typed encoder."""
    return b"kv1" + msgspec.msgpack.encode(fields)


DROP: Any = object()  # a field to leave out


def reg(**over: Any) -> dict[str, Any]:
    fields = {"k": "reg", **COMMON, "engine_id": "e", "block_ids": BLOCKS, "deadline": 1.0}
    return {k: v for k, v in (fields | over).items() if v is not DROP}


def other(kind: str, **over: Any) -> dict[str, Any]:
    """A `kind` message: the common fields only, plus `over`."""
    return reg(k=kind, engine_id=DROP, block_ids=DROP, deadline=DROP) | over


def hb(**over: Any) -> dict[str, Any]:
    return {"k": "hb", "request_ids": ["a"], "rank": 0} | over


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Any) -> None:
    payload = encode(message)
    assert payload.startswith(b"kv1")
    back = decode(payload)
    assert type(back) is type(message)
    assert back == message


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == set(TYPES)
    assert decode(raw(**reg())) == Registration(
        **COMMON, engine_id="e", block_ids=BLOCKS, deadline=1.0
    )
    assert decode(raw(**hb())) == Heartbeat(request_ids=["a"], rank=0)


def _with_invalid_utf8(payload: bytes, text: str) -> bytes:
    """Replace the msgpack string `text` (4 ASCII chars) with 4 bytes that are not UTF-8."""
    needle = b"\xa4" + text.encode()
    assert payload.count(needle) == 1
    return payload.replace(needle, b"\xa4\xff\xfe\xc0\x80")


REJECTED = {
    "wrong_magic": b"kv2" + VALID[3][3:],
    "no_magic": VALID[3][3:],
    "empty": b"",
    "magic_only": b"kv1",
    "oversize": b"kv1" + b"\x00" * MAX_MESSAGE_BYTES,
    "not_msgpack": b"kv1\xc1",
    "not_a_map": b"kv1" + msgspec.msgpack.encode([1, 2]),
    "trailing_bytes": VALID[3] + b"\x00",
    "rank_str": raw(**reg(rank="0")),
    "rank_float": raw(**reg(rank=1.0)),
    "rank_bool": raw(**reg(rank=True)),
    "tp_none": raw(**reg(tp_size=None)),
    "id_int": raw(**reg(request_id=5)),
    "blocks_list": raw(**reg(block_ids=[1, 2, 3, 4])),
    "blocks_str": raw(**reg(block_ids="abcd")),
    "deadline_str": raw(**reg(deadline="soon")),
    "ids_str": raw(**hb(request_ids="abc")),
    "ids_of_int": raw(**hb(request_ids=[1])),
    "unknown_tag": raw(**reg(k="nope")),
    "tag_int": raw(**reg(k=1)),
    "missing_tag": raw(**reg(k=DROP)),
    "missing_field": raw(**reg(deadline=DROP)),
    "unknown_field": raw(**reg(extra=1)),
    "hb_unknown_field": raw(**hb(tp_size=1)),
    "negative_rank": raw(**reg(rank=-1)),
    "hb_negative_rank": raw(**hb(rank=-1)),
    "tp_zero": raw(**reg(tp_size=0)),
    "tp_negative": raw(**other("done", tp_size=-2)),
    "blocks_3_bytes": raw(**reg(block_ids=b"\x01\x02\x03")),
    "blocks_6_bytes": raw(**reg(block_ids=b"\x01" * 6)),
    "grant_blocks_2_bytes": raw(**reg(k="grant", engine_id=DROP, block_ids=b"\x00" * 2)),
    "grant_blocks_5_bytes": raw(**reg(k="grant", engine_id=DROP, block_ids=b"\x00" * 5)),
    "utf8_in_id": _with_invalid_utf8(raw(**reg(request_id="abcd")), "abcd"),
    "utf8_in_reason": _with_invalid_utf8(raw(**other("fail", reason="oops")), "oops"),
    "utf8_in_hb_ids": _with_invalid_utf8(raw(**hb(request_ids=["wxyz"])), "wxyz"),
    "utf8_in_tag": _with_invalid_utf8(raw(**reg(k="abcd")), "abcd"),
}

# why some of them are rejected: the check under test, not an earlier one
REASONS = {
    "wrong_magic": "not a kvfsm v1",
    "oversize": "exceeds",
    "negative_rank": "impossible rank/tp",
    "hb_negative_rank": "impossible rank/tp",
    "tp_zero": "impossible rank/tp",
    "tp_negative": "impossible rank/tp",
    "blocks_3_bytes": "whole number of int32",
    "grant_blocks_5_bytes": "whole number of int32",
    "blocks_6_bytes": "whole number of int32",
    "grant_blocks_2_bytes": "whole number of int32",
    "unknown_field": "unknown field `extra`",
    "unknown_tag": "Invalid value 'nope'",
    "rank_bool": "Expected `int`, got `bool`",
    **{case: "malformed notification" for case in REJECTED if case.startswith("utf8")},
}


@pytest.mark.parametrize("case", REJECTED)
def test_decode_rejects(case: str) -> None:
    with pytest.raises(WireError, match=REASONS.get(case)):
        decode(REJECTED[case])


def test_rejected_payloads_differ_only_in_the_field_under_test() -> None:
    assert decode(raw(**other("done", tp_size=1))) == Completion(**{**COMMON, "tp_size": 1})
    grant = decode(raw(**reg(k="grant", engine_id=DROP, block_ids=b"\0" * 8)))
    assert isinstance(grant, Grant) and grant.block_ids == b"\0" * 8
    assert decode(raw(**other("fail", reason="oops"))) == Failure(**COMMON, reason="oops")
    assert decode(raw(**hb(request_ids=["wxyz"]))) == Heartbeat(request_ids=["wxyz"], rank=0)
    assert cast(Registration, decode(raw(**reg(request_id="abcd")))).request_id == "abcd"
    assert decode(raw(**reg(rank=0))).rank == 0


def test_size_limit_boundary() -> None:
    def sized(n_blocks: int, pad: int) -> bytes:
        return encode(reg_msg(b"\x00" * n_blocks, "e" * pad))

    def reg_msg(blocks: bytes, engine: str) -> Registration:
        return Registration(**COMMON, engine_id=engine, block_ids=blocks, deadline=1.0)

    base = len(sized(1 << 19, 0))  # bin32 header, fixstr engine id: both fixed-size from here
    room = MAX_MESSAGE_BYTES - base
    exact = sized((1 << 19) + room - room % 4, room % 4)
    assert len(exact) == MAX_MESSAGE_BYTES
    assert len(cast(Registration, decode(exact)).block_ids) == (1 << 19) + room - room % 4
    with pytest.raises(WireError, match="exceeds"):
        decode(sized((1 << 19) + room - room % 4 + 4, room % 4))


@pytest.mark.parametrize("payload", VALID, ids=[type(m).__name__ for m in MESSAGES])
def test_every_truncation_is_rejected(payload: bytes) -> None:
    for end in range(len(payload)):
        with pytest.raises(WireError):
            decode(payload[:end])


def test_deep_nesting_is_a_wire_error() -> None:
    payload = b"kv1\x81\xa1x" + b"\x91" * 5000 + b"\xc0"  # {"x": [[[...nil...]]]}
    assert len(payload) < MAX_MESSAGE_BYTES
    with pytest.raises(WireError):
        decode(payload)


def _check_decode(payload: bytes) -> None:
    try:
        message = decode(payload)
    except WireError:
        return
    assert isinstance(message, TYPES)
    assert message.rank >= 0
    assert decode(encode(message)) == message


@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _check_decode(data)
    _check_decode(b"kv1" + data)


@given(st.sampled_from(VALID), st.data())
def test_fuzz_mutated_encodings(payload: bytes, data: st.DataObject) -> None:
    buf = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        pos = data.draw(st.integers(0, len(buf)), label="pos")
        kind = data.draw(st.sampled_from(["flip", "insert", "delete", "cut"]), label="kind")
        byte = data.draw(st.integers(0, 255), label="byte")
        if kind == "flip" and pos < len(buf):
            buf[pos] = byte
        elif kind == "insert":
            buf.insert(pos, byte)
        elif kind == "delete" and pos < len(buf):
            del buf[pos]
        elif kind == "cut":
            del buf[pos:]
    _check_decode(bytes(buf))


@pytest.mark.parametrize("ids", [[], [0], [5, 3, 9, 0, 2**31 - 1], list(range(300_000))])
def test_pack_unpack_blocks(ids: list[int]) -> None:
    packed = pack_blocks(ids)
    assert len(packed) == 4 * len(ids)
    out = unpack_blocks(packed)
    assert out.dtype == np.dtype("<i4")
    assert out.tolist() == ids
    assert not out.flags.writeable
    assert pack_blocks(np.asarray(ids, dtype=np.int64)) == packed


@pytest.mark.parametrize("ids", [[-1], [2**31], np.array([2**32 + 5])])
def test_pack_rejects_ids_that_do_not_fit(ids: object) -> None:
    with pytest.raises(ValueError, match="block ids must lie in"):
        pack_blocks(ids)  # type: ignore[arg-type]


def test_pack_is_little_endian_int32() -> None:
    assert pack_blocks([1, 2**31 - 2]) == b"\x01\x00\x00\x00\xfe\xff\xff\x7f"
    assert pack_blocks(np.array([258], dtype=">i4")) == b"\x02\x01\x00\x00"
    assert unpack_blocks(b"").size == 0


@pytest.mark.parametrize(
    ("request_id", "base"),
    [
        ("req-1-0123abcd", "req-1"),
        ("req-1-0123ABCD", "req-1"),
        ("req-1-DeadBeef", "req-1"),
        ("req-1-0123abc", "req-1-0123abc"),
        ("req-1-0123abcde", "req-1-0123abcde"),
        ("req0123abcd", "req0123abcd"),
        ("0123abcd", "0123abcd"),
        ("req-1-0123abcg", "req-1-0123abcg"),
        ("req-1-0123 bcd", "req-1-0123 bcd"),
        ("req-1-0123abcd-89abcdef", "req-1-0123abcd"),
        ("req-1", "req-1"),
        ("", ""),
    ],
)
def test_base_request_id(request_id: str, base: str) -> None:
    assert base_request_id(request_id) == base
