"""The side channel with a shared secret, over real ZMQ sockets on 127.0.0.1: tagged requests and
replies (acceptances and refusals), every mismatch a clear error on both ends, replayed
acceptances and forged refusals refused, and the listener's guests (the agents whose handshakes
it accepted)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq

from kvfsm.runtime import HandshakeError
from kvfsm.sidechannel import (
    HandshakeAccepted,
    HandshakeListener,
    HandshakeRefused,
    HandshakeRequest,
    Unauthenticated,
    decode_reply,
    decode_request,
    encode,
    fetch_peer,
)
from kvfsm.wire import SharedSecret
from tests.sidechannel.fixtures import HASH, HOST, PAYLOADS, SAFETY_S, WIRE

SECRET = SharedSecret(b"a-deployment-secret-0123456789")
OTHER = SharedSecret(b"another-deployment-secret-99")


@pytest.fixture
def guarded() -> Iterator[HandshakeListener]:
    with HandshakeListener(PAYLOADS.get, secret=SECRET) as served:
        yield served


def _fetch(port: int, secret: SharedSecret | None, requester: str = "decode#0") -> object:
    return fetch_peer(
        HOST,
        port,
        "prefill#0",
        compat_hash=HASH,
        wire_version=WIRE,
        timeout_s=SAFETY_S,
        secret=secret,
        requester=requester,
    )[0]


def test_holders_of_the_secret_handshake_and_become_guests(guarded: HandshakeListener) -> None:
    assert _fetch(guarded.port, SECRET) == PAYLOADS["prefill#0"]
    assert guarded.counters == {"accepted": 1}
    assert guarded.guests.admitted("prefill#0", "decode#0")
    assert not guarded.guests.admitted("prefill#1", "decode#0")  # per served agent


@pytest.mark.parametrize(
    ("secret", "says"),
    [
        (None, "refused.*authentication failed: untagged request"),  # read, not checked
        (OTHER, "without proof.*it claims: 'authentication failed: request with a wrong tag"),
    ],
    ids=["no-secret", "another-secret"],
)
def test_the_listener_refuses_strangers_and_says_why(
    guarded: HandshakeListener, secret: SharedSecret | None, says: str
) -> None:
    with pytest.raises(HandshakeError, match=says):
        _fetch(guarded.port, secret)
    assert guarded.counters == {"unauthenticated": 1}
    assert len(guarded.guests) == 0  # a stranger is nobody's guest


def test_an_asker_with_a_secret_refuses_a_listener_without_it() -> None:
    with (
        HandshakeListener(PAYLOADS.get) as open_listener,
        pytest.raises(HandshakeError, match="without proof of the shared secret"),
    ):
        _fetch(open_listener.port, SECRET)


def test_a_tagged_acceptance_cannot_be_replayed_for_another_request() -> None:
    """A recorded acceptance (say, of an agent's previous incarnation) answers only its own
    request: the tag covers the request's nonce."""
    with HandshakeListener(PAYLOADS.get, secret=SECRET) as served:
        first = _raw_exchange(
            served.port, HandshakeRequest("prefill#0", WIRE, HASH, "d", b"1" * 16)
        )
    assert isinstance(decode_reply(first, SECRET, b"1" * 16), HandshakeAccepted)
    with pytest.raises(Unauthenticated, match="wrong tag"):
        decode_reply(first, SECRET, b"2" * 16)
    # Served to a fresh asker by a fake listener, it is refused with a clear error.
    with _ReplayingListener(first) as port, pytest.raises(HandshakeError, match="without proof"):
        _fetch(port, SECRET)


def test_a_refusal_is_tagged_and_a_forged_one_is_not_taken_as_the_listeners() -> None:
    """The listener's own refusal (here: another model) is tagged for the request and read as
    its word; an untagged one from whoever else answers is reported as unauthenticated."""
    with HandshakeListener(PAYLOADS.get, secret=SECRET) as served:
        with pytest.raises(HandshakeError, match=r"refused.*compat hash mismatch") as caught:
            fetch_peer(
                HOST,
                served.port,
                "prefill#0",
                compat_hash="another-model",
                wire_version=WIRE,
                timeout_s=SAFETY_S,
                secret=SECRET,
            )
        assert "without proof" not in str(caught.value)
    forged = encode(HandshakeRefused("compat hash mismatch: forged"))
    with _ReplayingListener(forged) as port, pytest.raises(HandshakeError) as caught:
        _fetch(port, SECRET)
    assert "without proof" in str(caught.value) and "it claims: 'compat hash" in str(caught.value)


def test_tagged_frames_decode_and_check() -> None:
    request = HandshakeRequest("prefill#0", WIRE, HASH, "decode#0", b"n" * 16)
    frame = encode(request, SECRET)
    assert decode_request(frame, SECRET) == request
    assert decode_request(frame) == request  # a listener without a secret reads it
    with pytest.raises(Unauthenticated):
        decode_request(frame, OTHER)
    with pytest.raises(Unauthenticated, match="untagged"):
        decode_request(encode(request), SECRET)
    tampered = bytearray(frame)
    tampered[-1] ^= 1
    with pytest.raises(Unauthenticated):
        decode_request(bytes(tampered), SECRET)


def _raw_exchange(port: int, request: HandshakeRequest) -> bytes:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(SAFETY_S * 1000))
        sock.connect(f"tcp://{HOST}:{port}")
        sock.send(encode(request, SECRET))
        return sock.recv()
    finally:
        sock.close()


class _ReplayingListener:
    """A ROUTER that answers every request with one recorded reply."""

    def __init__(self, reply: bytes) -> None:
        self._reply = reply
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port: int = self._sock.bind_to_random_port(f"tcp://{HOST}")
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        if self._sock.poll(int(SAFETY_S * 1000)):
            envelope = self._sock.recv_multipart()[:2]
            self._sock.send_multipart([*envelope, self._reply])

    def __enter__(self) -> int:
        self._thread.start()
        return self.port

    def __exit__(self, *exc: object) -> None:
        self._thread.join(SAFETY_S)
        self._sock.close()
