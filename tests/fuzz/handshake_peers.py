"""What the side-channel fuzz and load tests serve and ask for: two prefill ranks' payloads, the
lookup a listener runs (with one agent whose lookup fails, to count `errors`), the outcome the
listener must count for any request frames, and hostile frames. Shared by the tests and by the
flood process of test_sidechannel_load.py (which imports it by path)."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st

from kvfsm.layout import KvGeometry
from kvfsm.sidechannel import (
    MAX_HANDSHAKE_BYTES,
    HandshakePayload,
    HandshakeRequest,
    SidechannelError,
    compat_hash,
    decode_request,
    encode,
)
from tests.fuzz.strategies import ints, mutated_bytes, texts

HOST = "127.0.0.1"
WIRE = 1
GEOMETRY = KvGeometry(
    num_layers=4,
    num_kv_heads=8,
    head_dim=64,
    dtype_bytes=2,
    block_size=16,
    num_blocks=256,
    tp_size=2,
)
HASH = compat_hash(wire_version=WIRE, mode="push", model="m", dtype="bf16", geometry=GEOMETRY)
BOOM = "boom#0"
"""The agent whose payload lookup raises: the listener must answer `errors` and carry on."""
SAFETY_S = 10.0
"""Bounds every wait for an answer; never reached when things work."""


def payload(rank: int) -> HandshakePayload:
    """Prefill rank `rank`'s payload (consistent: it passes `validate`)."""
    g = GEOMETRY.for_rank(rank)
    return HandshakePayload(
        engine_id="prefill",
        agent=f"prefill#{rank}",
        agent_metadata=b"nixl-metadata-%d" % rank,
        geometry=g,
        base_addresses=tuple(0x7F0000000000 + (rank * 64 + i) * g.region_bytes for i in range(8)),
        block_lens=(g.block_len,) * g.num_regions,
        mode="push",
        wire_version=WIRE,
        compat_hash=HASH,
    )


PAYLOADS = {p.agent: p for p in (payload(0), payload(1))}


def lookup(agent: str) -> HandshakePayload | None:
    """The listener's payload lookup."""
    if agent == BOOM:
        raise RuntimeError("lookup exploded")
    return PAYLOADS.get(agent)


def request(agent: str, wire_version: int = WIRE, hash_: str = HASH) -> bytes:
    """An encoded request frame."""
    return encode(HandshakeRequest(agent=agent, wire_version=wire_version, compat_hash=hash_))


def expected_outcome(frames: list[bytes]) -> str:
    """What `HandshakeListener` counts for `frames` sent from a DEALER (its documented
    contract: a leading empty frame is a REQ delimiter; oversized before frame count before
    decoding; unknown agents and mismatches refused; a failing lookup is an error)."""
    body = frames[1:] if frames and frames[0] == b"" else frames
    if sum(len(f) for f in body) > MAX_HANDSHAKE_BYTES:
        return "oversized"
    if len(body) != 1:
        return "malformed"
    try:
        asked = decode_request(body[0])
    except SidechannelError:
        return "malformed"
    if asked.agent == BOOM:
        return "errors"
    served = PAYLOADS.get(asked.agent)
    if served is None or (asked.wire_version, asked.compat_hash) != (WIRE, HASH):
        return "refused"
    return "accepted"


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A request frame of a kind drawn first (so that every outcome is frequent): valid, for
    an agent not served, for the failing lookup, with the wrong version or hash, or random."""
    kind = draw(st.sampled_from(["valid", "valid", "other", "boom", "version", "hash", "any"]))
    agent = draw(st.sampled_from([*PAYLOADS]))
    if kind == "other":
        agent = draw(st.one_of(st.sampled_from(["decode#0", "", "#"]), texts))
    elif kind == "boom":
        agent = BOOM
    version = draw(ints) if kind in ("version", "any") else WIRE
    hash_ = draw(texts) if kind in ("hash", "any") else HASH
    if kind == "any":
        agent = draw(st.one_of(st.sampled_from([*PAYLOADS, BOOM]), texts))
    return request(agent, version, hash_)


"""Request frames: valid ones, unknown agents, the failing lookup, mismatched versions/hashes."""

request_frames = st.one_of(
    requests(),
    requests().flatmap(mutated_bytes),
    st.binary(max_size=64),
    st.binary(max_size=64).map(lambda b: b"kvhs1" + b),
    st.builds(lambda v: b"kvhs1" + msgspec.msgpack.encode(v), st.dictionaries(texts, ints)),
)
"""One frame of a request: valid, mutated, garbage, or our magic over garbage."""

_OVERSIZED = b"x" * (MAX_HANDSHAKE_BYTES + 1)  # within ZMQ's hard limit: answered, counted


@st.composite
def frame_lists(draw: st.DrawFn) -> list[bytes]:
    """What one DEALER message to a listener may carry: a request, any frame, either with a
    REQ-style empty delimiter, several frames, an empty message, an oversized one."""
    shape = draw(st.sampled_from(["request", "request", "frame", "req-style", "many", "empty"]))
    if shape == "request":
        return [draw(requests())]
    if shape == "frame":
        return [draw(request_frames)]
    if shape == "req-style":
        return [b"", draw(request_frames)]
    if shape == "many":
        return draw(st.lists(request_frames, min_size=2, max_size=3))
    return [b""] if draw(st.integers(0, 9)) else [_OVERSIZED]
