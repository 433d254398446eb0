"""The asking end of the handshake: one bounded request/reply, then checks of what came back."""

from __future__ import annotations

import zmq

from kvfsm.core import agent_name
from kvfsm.runtime import HandshakeError
from kvfsm.sidechannel._payload import (
    _HARD_LIMIT_BYTES,
    HandshakePayload,
    HandshakeRefused,
    HandshakeRequest,
    SidechannelError,
    decode_reply,
    encode,
)

__all__ = ["fetch_payload", "validate"]


def fetch_payload(
    host: str,
    port: int,
    agent: str,
    *,
    compat_hash: str,
    wire_version: int,
    timeout_s: float,
) -> HandshakePayload:
    """Ask the listener at `host:port` for `agent`'s payload; raise `HandshakeError` saying why
    when nothing answers within `timeout_s`, the listener refuses, or the reply is undecodable or
    for another agent, wire version or compat hash. Geometry is left to `validate`."""
    where = f"{host}:{port}"
    request = HandshakeRequest(agent, wire_version, compat_hash)
    data = _exchange(host, port, encode(request), timeout_s)
    try:
        reply = decode_reply(data)
    except SidechannelError as exc:
        raise HandshakeError(f"undecodable reply from {where} for {agent!r}: {exc}") from exc
    if isinstance(reply, HandshakeRefused):
        raise HandshakeError(f"{where} refused the handshake for {agent!r}: {reply.reason}")
    payload = reply.payload
    _check_identity(payload, agent, where)
    if payload.wire_version != wire_version:
        raise HandshakeError(
            f"wire version mismatch with {agent!r} at {where}: "
            f"we speak {wire_version}, it speaks {payload.wire_version}"
        )
    if payload.compat_hash != compat_hash:
        raise HandshakeError(
            f"compat hash mismatch with {agent!r} at {where}: "
            f"we have {compat_hash}, it has {payload.compat_hash}"
        )
    return payload


def _exchange(host: str, port: int, request: bytes, timeout_s: float) -> bytes:
    where = f"{host}:{port}"
    timeout_ms = max(1, round(timeout_s * 1000))
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    try:
        # LINGER 0: an unanswered request must not keep the socket (or the process) alive.
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, _HARD_LIMIT_BYTES)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        try:
            sock.connect(endpoint)
            # Without IMMEDIATE a REQ queues the request at once; a single poll then bounds the
            # whole exchange by `timeout_s`, whether or not anything listens.
            sock.send(request, zmq.NOBLOCK)
            if not sock.poll(timeout_ms, zmq.POLLIN):
                raise HandshakeError(f"no answer from {where} within {timeout_s:g}s")
            return sock.recv(zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise HandshakeError(f"handshake with {where} failed: {exc}") from exc
    finally:
        sock.close(linger=0)


def _check_identity(payload: HandshakePayload, agent: str, where: str) -> None:
    engine_id, sep, _ = agent.rpartition("#")
    if sep and payload.engine_id != engine_id:
        raise HandshakeError(
            f"engine id mismatch: asked for {engine_id!r}, got {payload.engine_id!r} "
            f"(agent {agent!r} at {where})"
        )
    if payload.agent != agent:
        raise HandshakeError(
            f"agent mismatch: asked for {agent!r}, got {payload.agent!r} at {where}"
        )
    if agent_name(payload.engine_id, payload.rank) != payload.agent:
        raise HandshakeError(
            f"inconsistent payload from {where}: agent {payload.agent!r} is not "
            f"engine {payload.engine_id!r} rank {payload.rank}"
        )


def validate(
    payload: HandshakePayload,
    *,
    expect_mode: str | None = None,
    tp_size: int | None = None,
    block_size: int | None = None,
    kv_layout: str | None = None,
) -> None:
    """Check a payload's geometry; raise `HandshakeError` listing every problem.

    Always: blocks and bytes exist, the rank lies within the TP size. With the local side's
    values: the modes and KV layouts are equal, and the TP sizes and block sizes divide each other
    (they may differ: each side maps blocks and head slices by the ratio).
    """
    p = payload
    problems = []
    if p.num_blocks < 1:
        problems.append(f"num_blocks must be > 0, got {p.num_blocks}")
    if p.block_bytes < 1:
        problems.append(f"block_bytes must be > 0, got {p.block_bytes}")
    if p.block_size < 1:
        problems.append(f"block_size must be > 0, got {p.block_size}")
    if p.base_address < 0:
        problems.append(f"base_address must be >= 0, got {p.base_address}")
    if p.tp_size < 1 or not 0 <= p.rank < p.tp_size:
        problems.append(f"rank {p.rank} does not lie within TP size {p.tp_size}")
    if expect_mode is not None and p.mode != expect_mode:
        problems.append(f"mode mismatch: we run {expect_mode!r}, peer runs {p.mode!r}")
    if kv_layout is not None and p.kv_layout != kv_layout:
        problems.append(f"kv layout mismatch: we use {kv_layout!r}, peer uses {p.kv_layout!r}")
    if tp_size is not None and not _divides(tp_size, p.tp_size):
        problems.append(f"TP sizes {tp_size} (ours) and {p.tp_size} (peer's) do not divide")
    if block_size is not None and not _divides(block_size, p.block_size):
        problems.append(
            f"block sizes {block_size} (ours) and {p.block_size} (peer's) do not divide"
        )
    if problems:
        raise HandshakeError(f"bad handshake payload from {p.agent!r}: " + "; ".join(problems))


def _divides(a: int, b: int) -> bool:
    return a > 0 and b > 0 and max(a, b) % min(a, b) == 0
