"""Loopback ports for tests and harnesses.

A port the kernel handed out by binding port 0 lies in its ephemeral range, where any outgoing
connection (UCX, ZMQ, vLLM's own sockets) may take it as a local port before the process meant to
listen on it binds: a parallel test run then fails with "address in use". `free_port` picks from
below that range instead, where only an explicit bind can take a port, and gives each pytest-xdist
worker its own slice, so two workers never pick the same one.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

__all__ = ["free_port"]

_LOWEST = 10_000  # above the well-known and most registered service ports
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _slice() -> range:
    """This process's ports: its xdist worker's share of [_LOWEST, the ephemeral range)."""
    top = _ephemeral_low()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    width = (top - _LOWEST) // max(count, 1)
    return range(_LOWEST + index * width, _LOWEST + (index + 1) * width)


def _candidates(ports: range) -> itertools.cycle[int]:
    start = os.getpid() % len(ports)  # processes of one worker (forks) start apart
    return itertools.cycle([*ports[start:], *ports[:start]])


_next: tuple[int, itertools.cycle[int]] | None = None  # (owner pid, candidates): forks restart


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host`, free a moment ago and outside the kernel's ephemeral range.

    Successive calls in one process return different ports. Falls back to the kernel's choice
    (bind to port 0) where the range below the ephemeral one is too small to share out.
    """
    global _next
    if _ephemeral_low() - _LOWEST < 1_000:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    ports = _slice()
    if _next is None or _next[0] != os.getpid():
        _next = (os.getpid(), _candidates(ports))
    for _, port in zip(ports, _next[1], strict=False):  # each candidate once at most
        if _bindable(host, port):
            return port
    raise OSError(f"no free port on {host} in {ports}")
