"""Hypothesis strategies shared by the fuzz tests: hostile leaf values, byte-level mutations of
valid encodings, structural mutations of decoded trees (what a peer that speaks the format but
lies in it sends), bogus wire messages of every type, and a TOML writer for mutated scenarios.

Messages are built with the public constructors and keyword arguments only, so fields that gain
defaults later (an HMAC, a requester) do not break these strategies.
"""

from __future__ import annotations

import copy
import datetime as dt
import math
from collections.abc import Callable
from typing import Any

import msgspec
from hypothesis import strategies as st

from kvfsm.wire import (
    Cancel,
    CancelAck,
    Completion,
    Failure,
    Grant,
    Heartbeat,
    Message,
    Progress,
    Registration,
    pack_blocks,
)

Draw = Callable[[st.SearchStrategy[Any]], Any]

# --- hostile leaves --------------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
"""Boundaries of the integer types a decoder or numpy may convert to."""

ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**64 - 1))
"""Any integer msgpack can carry (int64 and uint64), boundaries first."""

floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, 1e15]),
    st.floats(allow_nan=True, allow_infinity=True),
)
"""Any double: NaN and the infinities (clocks and deadlines must refuse or survive them)."""

texts = st.one_of(
    st.sampled_from(["", "#", "#0", "P#0", "D#0", "P#-1", "x" * 300, "\x00", "é☠", "a#b#1"]),
    st.text(max_size=24),
)
"""Strings, including agent-like names and control characters."""

msgpack_leaves = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=24))
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
"""Any msgpack value: what a decoder may meet in place of a field."""

# --- byte-level mutations ----------------------------------------------------------------------

_HEADERS = [0xC0, 0xC1, 0xC4, 0xC6, 0xCB, 0xD9, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0x91, 0x81]
"""msgpack type bytes: nil, never-used, bin8/32, float64, str8/32, array16/32, map16/32, fix."""


@st.composite
def mutated_bytes(draw: Draw, payload: bytes, max_mutations: int = 4) -> bytes:
    """`payload` with a few flips, insertions, deletions, cuts, duplications or msgpack type
    bytes (so length prefixes and tags get lied about, not only content)."""
    buf = bytearray(payload)
    for _ in range(draw(st.integers(1, max_mutations))):
        pos = draw(st.integers(0, len(buf)))
        kind = draw(st.sampled_from(["flip", "insert", "delete", "cut", "dup", "header"]))
        if kind == "flip" and pos < len(buf):
            buf[pos] = draw(st.integers(0, 255))
        elif kind == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and pos < len(buf):
            del buf[pos : pos + draw(st.integers(1, 8))]
        elif kind == "cut":
            del buf[pos:]
        elif kind == "dup":
            buf[pos:pos] = buf[pos : pos + draw(st.integers(1, 16))]
        elif kind == "header":  # a type byte, then a length of up to 4 GiB (or a cut one)
            length = b"\xff" * draw(st.integers(0, 4))
            buf[pos:pos] = bytes([draw(st.sampled_from(_HEADERS))]) + length
    return bytes(buf)


# --- structural mutations --------------------------------------------------------------------------


def as_tree(message: object) -> Any:
    """A message as the plain msgpack tree it travels as (bytes stay bytes)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(message))


@st.composite
def mutated_trees(
    draw: Draw, tree: Any, leaves: st.SearchStrategy[Any], max_mutations: int = 3
) -> Any:
    """`tree` (dicts and lists) with 1..`max_mutations` edits at random depths: a value replaced
    by one of `leaves`, an entry deleted, a key or element added, an element duplicated. The
    root stays a container (a TOML document is always a table)."""
    tree = copy.deepcopy(tree)
    for _ in range(draw(st.integers(1, max_mutations))):
        _mutate(draw, tree, leaves)
    return tree


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return list(node)
    if isinstance(node, list):
        return list(range(len(node)))
    return []


def _mutate(draw: Draw, node: Any, leaves: st.SearchStrategy[Any]) -> None:
    """Edit somewhere at or below the container `node`."""
    children = _children(node)
    if children and draw(st.booleans()):
        key = draw(st.sampled_from(children))
        if isinstance(node[key], dict | list):
            _mutate(draw, node[key], leaves)
            return
    op = draw(st.sampled_from(["replace", "delete", "add", "duplicate"]))
    if not children or op == "add":
        if isinstance(node, dict):
            node[draw(texts)] = draw(leaves)
        else:
            node.insert(draw(st.integers(0, len(node))), draw(leaves))
        return
    key = draw(st.sampled_from(children))
    if op == "replace":
        node[key] = draw(leaves)
    elif op == "delete":
        del node[key]
    elif isinstance(node, list):
        node.insert(key, copy.deepcopy(node[key]))
    else:
        node[draw(st.sampled_from(children))] = copy.deepcopy(node[key])


def leaves_from(*trees: Any) -> list[Any]:
    """Every scalar in `trees`: plausible values (agent names, states, sides) that get a mutated
    document past type checks and into the cross-checks."""
    found: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        else:
            found.append(node)

    for tree in trees:
        walk(tree)
    return sorted(set(found), key=repr)


# --- wire messages -------------------------------------------------------------------------------

block_payloads = st.one_of(
    st.binary(max_size=40),  # any length: not a whole number of int32 is a decode error
    st.lists(st.integers(0, 2**31 - 1), max_size=12).map(pack_blocks),
    st.sampled_from([b"", b"\xff\xff\xff\x7f" * 3, b"\xff\xff\xff\xff", b"\x00" * 4000]),
)
"""Block id lists: valid packings of huge ids, odd lengths, negative int32s."""


def wire_messages(ids: st.SearchStrategy[str] = texts) -> st.SearchStrategy[Message]:
    """Well-formed messages of every type with bogus ids (drawn from `ids`), ranks, TP sizes,
    block ids, deadlines and contacts: the codec encodes them all; what decodes is for the core
    to refuse or ignore."""
    # Mostly plausible ranks and TP sizes, so that most messages decode and reach the core.
    ranks = st.one_of(st.integers(0, 3), st.integers(0, 3), ints)
    tp_sizes = st.one_of(st.integers(1, 4), st.integers(1, 4), ints)
    common = {"request_id": ids, "sender_request_id": ids, "rank": ranks, "tp_size": tp_sizes}
    registrations = st.builds(
        Registration,
        **common,
        engine_id=texts,
        block_ids=block_payloads,
        deadline=floats,
        contact=texts,
    )
    return st.one_of(
        registrations,
        st.builds(Grant, **common, block_ids=block_payloads, deadline=floats),
        st.builds(Progress, **common),
        st.builds(Completion, **common),
        st.builds(Failure, **common, reason=texts),
        st.builds(Cancel, **common, contact=texts),
        st.builds(CancelAck, **common),
        st.builds(Heartbeat, request_ids=st.lists(ids, max_size=6), rank=ranks),
    )


# --- TOML ------------------------------------------------------------------------------------------

toml_leaves = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from(EDGE_INTS[:-1]),
    floats,
    st.text(st.characters(exclude_categories=["Cs"]), max_size=16),
    st.datetimes(timezones=st.none() | st.just(dt.UTC)),
    st.dates(),
    st.times(),
)
"""Every TOML scalar type (TOML has no null; its integers are 64-bit)."""


def toml_dumps(table: dict[str, Any]) -> str:
    """`table` as a TOML document: one `"key" = value` line per entry, nested values inline."""
    return "".join(f"{_toml_string(k)} = {_toml_value(v)}\n" for k, v in table.items())


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\' or ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, dt.date | dt.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{_toml_string(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"no TOML for {value!r}")
