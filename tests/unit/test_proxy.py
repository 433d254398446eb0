"""The proxy's own answers, before or without an engine: bad requests refused saying why, an
unreachable engine reported as 502 (the path through real engines: tests/vllm/test_http.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvfsm.harness.proxy import Proxy
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
