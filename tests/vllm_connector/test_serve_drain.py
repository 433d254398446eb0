"""Draining a prefill engine under load: two P and one D `vllm serve` engines (kvfsm, pull)
behind the project's proxy; `kvfsm drain` on one P while clients keep sending. No request fails
(every answer is the single-engine greedy completion), the drained P says so on `/metrics`
(`vllm:kvfsm_drained`) and stops cleanly, and D unloaded its NIXL agent on its goodbye
(`vllm:kvfsm_goodbyes`, `vllm:kvfsm_peers_removed`). docs/vllm.md, "Draining an engine"."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvfsm.cli import main
from kvfsm.harness.vllm_pd import make_tiny_llama
from tests.vllm_connector.fixtures.serving import deployment, tokens

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

PROMPTS = [[(13 * i + 5 * j) % 1000 + 1 for j in range(20 + 11 * i)] for i in range(8)]
D_CONNECTOR = {"kv_load_failure_policy": "recompute"}
_CLIENTS = 4


def test_a_p_drained_under_load_fails_no_request(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "llama")
    with deployment(model, "pull", tmp_path, prefill=2, decode=1, d_connector=D_CONNECTOR) as s:
        (p0, p1), d = s.prefill, s.decode[0]
        expected = [tokens(p1.address, x) for x in PROMPTS]  # one engine, no hand-off
        stop, answers, first = threading.Event(), [], threading.Event()

        def client(k: int) -> None:
            i = k
            while not stop.is_set():
                x = PROMPTS[i % len(PROMPTS)]
                answers.append((tokens(s.address, x), expected[i % len(PROMPTS)]))
                first.set()
                i += _CLIENTS

        with ThreadPoolExecutor(_CLIENTS) as pool:
            clients = [pool.submit(client, k) for k in range(_CLIENTS)]
            assert first.wait(120)
            where = f"127.0.0.1:{s.side_channels[p0.address]}"
            drained = main(["drain", where, "--wait", "120"])  # mid-load
            served_before = len(answers)
            while len(answers) < served_before + 2 * len(PROMPTS):  # more load after it
                if any(c.done() for c in clients):
                    break
                threading.Event().wait(0.1)  # pacing the load, not synchronising
            stop.set()
            for c in clients:
                c.result()  # a failed request raises here (HTTP error)
        assert drained == 0
        assert all(got == want for got, want in answers) and len(answers) > 2 * len(PROMPTS)
        assert p0.metric("vllm:kvfsm_drained") == 1 and p1.metric("vllm:kvfsm_drained") == 0
        assert d.metric("vllm:kvfsm_goodbyes_total") >= 1  # D heard P0 leave ...
        assert d.metric("vllm:kvfsm_peers_removed_total") >= 1  # ... and unloaded its agent
        p0.close()
        assert p0.process.returncode is not None
        assert tokens(s.address, PROMPTS[3]) == expected[3]  # P1 and D serve on
