"""The asking end of the handshake: one bounded request/reply, then checks of what came back."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from kvfsm.core import agent_name, check_tp_sizes
from kvfsm.layout import KvGeometry
from kvfsm.runtime import HandshakeError, plan_route
from kvfsm.sidechannel._clock import clock_offset
from kvfsm.sidechannel._payload import (
    _HARD_LIMIT_BYTES,
    HandshakePayload,
    HandshakeRefused,
    HandshakeRequest,
    SidechannelError,
    Unauthenticated,
    decode_reply,
    encode,
    new_nonce,
)
from kvfsm.wire import SharedSecret

__all__ = ["fetch_peer", "validate"]

_CLOCK_SLACK_S = 1e-3
"""How much longer than our round trip a listener may say it held a request: clock rates and
resolutions differ a little between hosts; a larger claim is a lie or a broken clock, and would
make the offset's error bound wrong (deadlines across hosts rest on it)."""


def fetch_peer(
    host: str,
    port: int,
    agent: str,
    *,
    compat_hash: str,
    wire_version: int,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    secret: SharedSecret | None = None,
    requester: str = "",
) -> tuple[HandshakePayload, float, float]:
    """Ask the listener at `host:port` for `agent`'s payload; raise `HandshakeError` saying why
    when nothing answers within `timeout_s`, the listener refuses, or the reply is undecodable or
    for another agent, wire version or compat hash. Geometry is left to `validate`. Returns the
    payload, the listener's clock minus ours (`clock`, the engines' clock) and the bound on that
    estimate's error: half the time the exchange spent travelling. With `secret`, the request
    is tagged and only an acceptance tagged for it is taken. `requester`: the asking agent, which
    the listener's engines then take notifications from."""
    where = f"{host}:{port}"
    nonce = b"" if secret is None else new_nonce()
    request = HandshakeRequest(agent, wire_version, compat_hash, requester, nonce)
    sent = clock()
    data = _exchange(host, port, encode(request, secret), timeout_s)
    received = clock()
    try:
        reply = decode_reply(data, secret, nonce)
    except Unauthenticated as exc:
        raise HandshakeError(
            f"{where} answered for {agent!r} without proof of the shared secret ({exc}): "
            f"the listener has no secret or another one"
        ) from exc
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
    held = reply.sent - reply.received
    if not 0.0 <= held <= (received - sent) + _CLOCK_SLACK_S:
        raise HandshakeError(
            f"impossible clocks from {where}: it says it held the request {held:.6g}s, but the "
            f"whole exchange took {received - sent:.6g}s here"
        )
    return (payload, *clock_offset(sent, reply.received, reply.sent, received))


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
    local: KvGeometry | None = None,
    local_is_p: bool = False,
) -> None:
    """Check a payload; raise `HandshakeError` listing every problem.

    Always: one base address and one block length per region, the lengths the geometry implies,
    regions that do not overlap. With `expect_mode`: the modes are equal. With the `local` rank's
    geometry (a P rank if `local_is_p`): the two KV caches can exchange blocks, i.e. same model
    geometry and page layout, TP sizes that divide each other, P's block size dividing D's, and
    the peer rank is one the local rank pairs with.
    """
    p, g = payload, payload.geometry
    problems = []
    if len(p.base_addresses) != g.num_regions:
        problems.append(
            f"{len(p.base_addresses)} base addresses for {g.num_regions} regions"
            f" ({g.num_layers} layers, K/V {'split' if g.split_kv else 'joint'})"
        )
    elif set(p.block_lens) != {g.block_len} or len(p.block_lens) != g.num_regions:
        problems.append(
            f"block lengths {sorted(set(p.block_lens))} do not match the geometry's {g.block_len}"
            f" bytes per block in each of {g.num_regions} regions"
        )
    else:
        try:
            p.layout()
        except ValueError as exc:
            problems.append(str(exc))
    if expect_mode is not None and p.mode != expect_mode:
        problems.append(f"mode mismatch: we run {expect_mode!r}, peer runs {p.mode!r}")
    if local is not None:
        try:
            check_tp_sizes(local.tp_size, g.tp_size)
            plan_route(local, g, local_is_p=local_is_p)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise HandshakeError(f"bad handshake payload from {p.agent!r}: " + "; ".join(problems))
