"""The proxy's own answers, before or without an engine: bad requests refused saying why, an
unreachable engine reported as 502 (the path through real engines: tests/vllm_connector/test_serve_llama.py)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, cast

import pytest

from kvfsm.serving.proxy import Proxy
from kvfsm.testing import free_port


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    served = Proxy(0, [nobody], [nobody]).start()
    yield served
    served.close()


def _post(proxy: Proxy, path: str, body: bytes) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(f"http://127.0.0.1:{proxy.port}{path}", body)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions", b"{}", 404),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b'{"prompt": [1], "stream": true}', 400),
    ],
)
def test_bad_requests_are_refused(proxy: Proxy, path: str, body: bytes, status: int) -> None:
    assert _post(proxy, path, body)[0] == status


def test_an_unreachable_engine_is_a_bad_gateway(proxy: Proxy) -> None:
    status, body = _post(proxy, "/v1/completions", b'{"prompt": [1, 2, 3], "max_tokens": 4}')
    assert status == 502 and "BadGateway" in json.dumps(body)


def test_a_proxy_needs_both_sides() -> None:
    with pytest.raises(ValueError, match="prefill and one decode"):
        Proxy(0, [], ["127.0.0.1:1"])


class _Engine:
    """A stand-in engine answering completions with what it was sent (and P's params)."""

    def __init__(self, name: str, params: dict[str, Any] | None = None) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen: list[dict[str, Any]] = []
        self.seen = seen
        params = params or {"from": name}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append(body)
                answer = json.dumps(
                    {"engine": name, "kv_transfer_params": params, "sent": body}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_engine_that_refuses_connections_is_passed_over() -> None:
    live_p, d = _Engine("p1"), _Engine("d")
    served = Proxy(0, [f"127.0.0.1:{free_port()}", live_p.address], [d.address]).start()
    try:
        for _ in range(4):  # round-robin lands on the dead P every other request
            status, body = _post(served, "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 3}')
            assert status == 200 and body["engine"] == "d"
            assert cast(dict[str, Any], body["sent"])["kv_transfer_params"] == {"from": "p1"}
        assert len(live_p.seen) == 4 and all(b["max_tokens"] == 1 for b in live_p.seen)
    finally:
        served.close()
        live_p.close()
        d.close()


def test_an_answer_says_how_long_prefill_and_decode_took() -> None:
    p, d = _Engine("p"), _Engine("d")
    served = Proxy(0, [p.address], [d.address]).start()
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{served.port}/v1/completions", b'{"prompt": [1], "max_tokens": 2}'
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            timing = answer.headers["Server-Timing"]
        prefill, decode = (part.strip().split(";dur=") for part in timing.split(","))
        assert (prefill[0], decode[0]) == ("prefill", "decode")
        assert float(prefill[1]) >= 0 and float(decode[1]) >= 0
    finally:
        served.close()
        p.close()
        d.close()


def test_a_draining_p_is_passed_over_and_if_all_drain_d_computes() -> None:
    draining = _Engine("p0", {"kvfsm_refused": "draining"})
    live_p, d = _Engine("p1"), _Engine("d")
    served = Proxy(0, [draining.address, live_p.address], [d.address]).start()
    try:
        for _ in range(4):
            status, body = _post(served, "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 3}')
            assert status == 200 and body["engine"] == "d"
            assert cast(dict[str, Any], body["sent"])["kv_transfer_params"] == {"from": "p1"}
        assert len(draining.seen) == 1 and served.refused_draining == 1  # then passed over
    finally:
        served.close()
        live_p.close()
    alone = Proxy(0, [draining.address], [d.address]).start()
    try:
        status, body = _post(alone, "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 3}')
        assert status == 200 and cast(dict[str, Any], body["sent"])["kv_transfer_params"] is None
    finally:
        alone.close()
        draining.close()
        d.close()
