"""A disaggregated-serving proxy: OpenAI completions in front of P and D `vllm serve` engines.

The contract of vLLM's toy proxy for its NIXL connector: each request goes to a prefill engine
with ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``; P's answer carries
the ``kv_transfer_params`` that the decode engine needs, and the request goes to D with them.
With several P and D engines, requests go round-robin, and an engine that does not accept the
connection (down, restarting) is passed over for the next one. A prefill engine that drains
answers ``kv_transfer_params={"kvfsm_refused": "draining"}`` (kvfsm's connector): the request
goes to the next P and that engine is passed over for `DRAINING_SKIP_S`; when every P drains,
D computes the prompt itself. Each answer's `Server-Timing`
header says how long P and D took. Standard library only; one thread a request. Run:
``python -m kvfsm.serving.proxy --port 8000 --prefill localhost:8100 --decode localhost:8200``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["DRAINING_SKIP_S", "Proxy", "main"]

_MAX_BODY = 16 << 20  # a completion request bigger than this is refused
_TIMEOUT_S = 600.0
DRAINING_SKIP_S = 30.0
"""How long a prefill engine that said it drains is passed over (then it is tried again: an
engine restarted at the same address serves)."""


class _Server(ThreadingHTTPServer):
    # The standard library's backlog of 5 resets connections beyond it: a burst of concurrent
    # clients (64 in tests/vllm_connector) must queue, as they do at vLLM's own server.
    request_queue_size = 1024
    daemon_threads = True


class Proxy:
    """Serves ``POST /v1/completions`` (and ``GET /health``) on `port`, prefilling on one of
    `prefill` and decoding on one of `decode` ("host:port" each)."""

    def __init__(self, port: int, prefill: Sequence[str], decode: Sequence[str]) -> None:
        if not prefill or not decode:
            raise ValueError("a proxy needs at least one prefill and one decode engine")
        self._p, self._d = itertools.cycle(prefill), itertools.cycle(decode)
        self._counts = len(prefill), len(decode)
        self._lock = threading.Lock()
        self._draining: dict[str, float] = {}  # P address -> when it said it drains
        self.refused_draining = 0
        """Prefills a draining P refused (each sent on to another P)."""
        self.server = _Server(("127.0.0.1", port), _handler(self))
        self.port = self.server.server_address[1]

    def complete(self, request: dict[str, Any]) -> tuple[int, bytes, str]:
        """One completion through P then D: the HTTP status and body D answered (or P's
        error, which ends the request there), and the time each took as a `Server-Timing`
        header value (`prefill;dur=MS, decode;dur=MS`)."""
        prefill = {**request, "max_tokens": 1, "stream": False}
        prefill["kv_transfer_params"] = {"do_remote_decode": True}
        t0 = time.perf_counter()
        params = None
        for _ in range(self._counts[0]):
            status, body, address = self._post_any(self._p, self._counts[0], prefill, True)
            if not address:  # every P drains: D computes the prompt
                break
            if status != 200:
                return status, body, f"prefill;dur={(time.perf_counter() - t0) * 1e3:.3f}"
            params = json.loads(body).get("kv_transfer_params")
            if not (isinstance(params, dict) and params.get("kvfsm_refused") == "draining"):
                break
            with self._lock:
                self._draining[address] = time.monotonic()
                self.refused_draining += 1
            params = None
        t1 = time.perf_counter()
        decode = {**request, "kv_transfer_params": params}
        status, body, _ = self._post_any(self._d, self._counts[1], decode)
        ms = ((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
        return status, body, "prefill;dur={:.3f}, decode;dur={:.3f}".format(*ms)

    def _post_any(
        self, engines: Iterator[str], count: int, body: dict[str, Any], prefill: bool = False
    ) -> tuple[int, bytes, str]:
        """`body` to the next engine in turn that accepts the connection (for a prefill, one
        that did not say it drains); the status, body and the engine ("" if none was tried)."""
        error: dict[str, Any] = {"error": {"message": "no engine", "type": "BadGateway"}}
        tried = ""
        for _ in range(count):
            with self._lock:
                address = next(engines)
                said = self._draining.get(address)
            if prefill and said is not None and time.monotonic() - said < DRAINING_SKIP_S:
                continue
            tried = address
            try:
                return (*_post(address, body), address)
            except _Unreachable as exc:
                error = {"error": {"message": str(exc), "type": "BadGateway"}}
        return 502, json.dumps(error).encode(), tried

    def serve_forever(self) -> None:
        """Serve until `close`."""
        self.server.serve_forever()

    def start(self) -> Proxy:
        """Serve on a daemon thread."""
        threading.Thread(target=self.serve_forever, name="kvfsm-proxy", daemon=True).start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()


def _post(address: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"http://{address}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as answer:
            return int(answer.status), bytes(answer.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            raise _Unreachable(f"{address}: {exc.reason}") from None
        return _bad_gateway(address, exc)
    except OSError as exc:  # the engine took the request and failed to answer: not retried
        return _bad_gateway(address, exc)


class _Unreachable(OSError):
    """The engine refused the connection: the request never reached it."""


def _bad_gateway(address: str, exc: OSError) -> tuple[int, bytes]:
    error = {"error": {"message": f"{address}: {exc}", "type": "BadGateway"}}
    return 502, json.dumps(error).encode()


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(200 if self.path == "/health" else 404, b"{}")

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._answer(404, b'{"error": "only /v1/completions"}')
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= _MAX_BODY:
                self._answer(413 if length else 400, b'{"error": "bad request body size"}')
                return
            try:
                request = json.loads(self.rfile.read(length))
                if not isinstance(request, dict) or request.get("stream"):
                    raise ValueError("a JSON object without streaming")
            except ValueError as exc:
                self._answer(400, json.dumps({"error": str(exc)}).encode())
                return
            status, body, timing = proxy.complete(request)
            self._answer(status, body, timing)

        def _answer(self, status: int, body: bytes, timing: str = "") -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if timing:
                self.send_header("Server-Timing", timing)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request on stderr is noise under load

    return Handler


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: ``--port``, ``--prefill HOST:PORT ...``, ``--decode HOST:PORT ...``."""
    parser = argparse.ArgumentParser(prog="python -m kvfsm.serving.proxy", description=__doc__)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", nargs="+", required=True, metavar="HOST:PORT")
    parser.add_argument("--decode", nargs="+", required=True, metavar="HOST:PORT")
    args = parser.parse_args(argv)
    proxy = Proxy(args.port, args.prefill, args.decode)
    print(f"kvfsm proxy on :{proxy.port}: prefill {args.prefill}, decode {args.decode}")
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        proxy.close()


if __name__ == "__main__":
    main()
