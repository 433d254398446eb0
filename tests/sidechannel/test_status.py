"""Questions about transfers over the side channel, on real ZMQ sockets on 127.0.0.1: answered
by the listener's `status`, tagged with the shared secret, and anything else (no answerer, a
wrong secret, a forged or undecodable answer, nothing listening) is "unanswered", never a
guess. `ZmqDirectory.ask` asks where the peer's handshake said to."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvfsm.core import TransferStatus
from kvfsm.runtime import StatusQuery
from kvfsm.sidechannel import HandshakeListener, StatusAnswer, ZmqDirectory, ask_status
from kvfsm.wire import SharedSecret
from tests.sidechannel.fixtures import HASH, HOST, PAYLOADS, SAFETY_S, WIRE

SECRET = SharedSecret(b"a-deployment-secret-0123456789")
OTHER = SharedSecret(b"another-deployment-secret-99")
QUERY = StatusQuery("prefill#0", "decode#0", "d-req", "p-req")


def _answer(query: StatusQuery) -> TransferStatus:
    return "done" if query.requester_request_id == "d-req" else "unknown"


@pytest.fixture
def listener() -> Iterator[HandshakeListener]:
    with HandshakeListener(PAYLOADS.get, secret=SECRET, status=_answer) as served:
        yield served


def test_a_question_is_answered_by_the_listeners_engine(listener: HandshakeListener) -> None:
    assert ask_status(HOST, listener.port, QUERY, timeout_s=SAFETY_S, secret=SECRET) == "done"
    other = StatusQuery("prefill#0", "decode#0", "not-ours")
    assert ask_status(HOST, listener.port, other, timeout_s=SAFETY_S, secret=SECRET) == "unknown"
    assert listener.counters == {"status_answered": 2}


@pytest.mark.parametrize("secret", [None, OTHER], ids=["untagged", "another secret"])
def test_a_question_without_the_secret_is_not_answered(
    listener: HandshakeListener, secret: SharedSecret | None
) -> None:
    assert ask_status(HOST, listener.port, QUERY, timeout_s=SAFETY_S, secret=secret) == (
        "unanswered"
    )
    assert listener.counters == {"status_refused": 1}


def test_a_listener_without_an_answerer_leaves_questions_unanswered() -> None:
    with HandshakeListener(PAYLOADS.get) as served:
        assert ask_status(HOST, served.port, QUERY, timeout_s=SAFETY_S) == "unanswered"
        assert served.counters == {"status_answered": 1}


def test_nothing_listening_is_unanswered_within_the_timeout() -> None:
    with HandshakeListener(PAYLOADS.get) as served:
        port = served.port
    assert ask_status(HOST, port, QUERY, timeout_s=0.2, secret=SECRET) == "unanswered"


def test_a_forged_done_is_refused() -> None:
    """Whoever answers in the listener's place cannot make a request pass as received: an
    untagged "done", or one tagged with another secret, is no answer."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    forged = [b"kvst1" + msgspec.msgpack.encode(StatusAnswer("done"))]

    def serve() -> None:
        if sock.poll(int(SAFETY_S * 1000)):
            envelope = sock.recv_multipart()[:2]  # the asker's identity and REQ's delimiter
            sock.send_multipart([*envelope, *forged])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert ask_status(HOST, port, QUERY, timeout_s=SAFETY_S, secret=SECRET) == "unanswered"
    finally:
        thread.join()
        sock.close(linger=0)


def test_the_directory_asks_where_the_handshake_was_answered(listener: HandshakeListener) -> None:
    with ZmqDirectory(
        {"prefill#0": (HOST, listener.port)},
        compat_hash=HASH,
        wire_version=WIRE,
        timeout_s=SAFETY_S,
        secret=SECRET,
        requester="decode#0",
    ) as directory:
        directory.ask("prefill#0", QUERY)  # no handshake yet: nowhere known to ask
        assert directory.answers() == [(QUERY, "unanswered")]
        directory.start("prefill#0")
        assert directory.wait(SAFETY_S)
        [(peer, _info)] = directory.results()
        assert peer == "prefill#0"
        directory.ask("prefill#0", QUERY)
        assert directory.wait(SAFETY_S)
        assert directory.answers() == [(QUERY, "done")]
