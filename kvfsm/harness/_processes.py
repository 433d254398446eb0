"""The driver's side of engine ranks in processes of their own.

`RankProcesses` starts each rank (`rank_main`, or the same behind a wrapper such as
`netns_main`) in a spawned process with a pipe to it, waits until every rank listens, tells
each where the others' listeners are, reads what they report and stops them, collecting each
rank's final counters. Every wait is bounded; a rank that dies is reported by name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from kvfsm.core import agent_name
from kvfsm.harness._rank import RankSpec, rank_main

__all__ = ["START_S", "RankMain", "RankProcesses"]

START_S = 120.0
"""How long ranks may take to start listening (a rank imports NIXL and starts its agent in a
few seconds; a loaded 2-core machine may take much longer)."""
_STOP_S = 30.0

RankMain = Callable[[RankSpec, Connection], None]
"""A rank process's body: `rank_main`, or a picklable wrapper around it."""


class RankProcesses:
    """Engine ranks, each in a spawned process, and the pipes that drive them (by agent name).

    The pipe protocol is `rank_main`'s: the driver sends ("peers", ...), ("admit_p", ...),
    ("admit_d", ...), probes and ("stop",); a rank sends ("ready", port), then what its engine
    reports, and ("counters", counters, errors, leftovers) once stopped.
    """

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self.pipes: dict[str, Connection] = {}
        self.procs: dict[str, BaseProcess] = {}

    def start(self, spec: RankSpec, main: RankMain = rank_main) -> str:
        """Start the rank `spec` describes, running `main(spec, pipe)`; returns its agent."""
        agent = agent_name(spec.side, spec.geometry.tp_rank)
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=main, args=(spec, child), daemon=True, name=agent)
        proc.start()
        child.close()  # only the rank holds its end now: its death resets the pipe
        self.pipes[agent], self.procs[agent] = parent, proc
        return agent

    def await_ready(self, timeout: float = START_S) -> dict[str, int]:
        """Each rank's listener port, once every rank has said it is ready."""
        ports: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while left := set(self.pipes) - set(ports):
            for agent, conn in self.readable(max(0.0, deadline - time.monotonic()), left):
                msg = conn.recv()
                if msg[0] != "ready":
                    raise RuntimeError(f"rank {agent} failed to start: {msg!r}")
                ports[agent] = msg[1]
            left = set(self.pipes) - set(ports)
            if left and (time.monotonic() > deadline or self.dead()):
                raise RuntimeError(f"rank processes did not all start: {sorted(left)}")
        return ports

    def connect(self, ports: Mapping[str, int], hosts: Mapping[str, str] | None = None) -> None:
        """Tell every rank where each rank's listener is (`hosts`: agent -> address, default
        loopback)."""
        peers = {a: ((hosts or {}).get(a, "127.0.0.1"), port) for a, port in ports.items()}
        for conn in self.pipes.values():
            conn.send(("peers", peers))

    def send(self, agent: str, msg: tuple[Any, ...]) -> None:
        """Send one message of the pipe protocol to `agent`'s rank."""
        self.pipes[agent].send(msg)

    def readable(
        self, timeout: float, among: set[str] | None = None
    ) -> list[tuple[str, Connection]]:
        """The ranks (of `among`, default all) with a message waiting, within `timeout`."""
        conns = [c for a, c in self.pipes.items() if among is None or a in among]
        ready = wait(conns, timeout=timeout)
        return [(a, c) for a, c in self.pipes.items() if c in ready]

    def dead(self) -> list[str]:
        """The ranks whose process has ended."""
        return [a for a, p in self.procs.items() if not p.is_alive()]

    def kill(self, agent: str, timeout: float = _STOP_S) -> None:
        """SIGKILL `agent`'s rank and forget it (a peer that dies, for tests)."""
        proc = self.procs.pop(agent)
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout)
        self.pipes.pop(agent).close()

    def stop(
        self, on_message: Callable[[str, tuple[Any, ...]], None] | None = None
    ) -> dict[str, Any]:
        """Stop every rank and forget it; returns each one's final ("counters", ...) message by
        agent (none for a rank that had died). Messages before it go to `on_message`, if given.
        Stopping again does nothing."""
        for conn in self.pipes.values():
            try:
                conn.send(("stop",))
            except OSError:  # the rank is gone
                continue
        finals: dict[str, Any] = {}
        for agent, conn in self.pipes.items():
            deadline = time.monotonic() + _STOP_S
            proc = self.procs[agent]
            try:
                while (time.monotonic() < deadline and proc.is_alive()) or conn.poll():
                    if not conn.poll(0.1):
                        continue
                    msg = conn.recv()
                    if msg[0] == "counters":
                        finals[agent] = msg
                        break
                    if on_message is not None:
                        on_message(agent, msg)
            except (EOFError, OSError):  # died, or a reset pipe when it died unread
                continue
        for proc in self.procs.values():
            proc.join(timeout=_STOP_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.pipes.values():
            conn.close()
        self.pipes.clear()
        self.procs.clear()
        return finals
