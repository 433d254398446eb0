"""free_port: ports outside the kernel's ephemeral range, distinct per call and per xdist worker."""

from __future__ import annotations

import itertools
import os
import socket

import pytest

from kvfsm.testing import _ports, free_port


def test_ports_lie_below_the_ephemeral_range_and_differ() -> None:
    low = _ports._ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(_ports._LOWEST <= p < low for p in ports)


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", taken))
        sock.listen()
        candidates = itertools.cycle([taken, taken + 1])
        monkeypatch.setattr(_ports, "_next", (os.getpid(), candidates))
        assert free_port() == taken + 1


def test_xdist_workers_get_disjoint_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    first = _ports._slice()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    second = _ports._slice()
    assert first.stop <= second.start
    assert second.stop <= _ports._ephemeral_low()
