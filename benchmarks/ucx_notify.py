"""`.venv/bin/python benchmarks/ucx_notify.py`: UCX's peer-failure detection against shared-memory
notifications, measured between two real NIXL agents in processes of their own.

NIXL's UCX backend takes `ucx_error_handling_mode`: "peer" (UCX detects a failed peer; on this
host notifications then travel over TCP loopback) or "none" (no detection; notifications go
over shared memory). For each mode an *echo* process answers an *initiator* process, both
polling NIXL without pause, and the initiator measures:

* `notify_rtt_us`: a notification and its answer, p50/p99;
* `xfer_notified_us`: one 16 KiB WRITE with a notification, from `transfer()` to the moment the
  echo drained that notification (the host's monotonic clock, shared by both processes);
* `pingpong_rps`: those WRITE-and-answer exchanges back to back, per second;
* `stream_rps_poll1ms`: a notification then a WRITE, each WRITE awaited until DONE only, while
  the echo polls every 1 ms (a peer that is busy elsewhere): whether a transfer waits for the
  peer to poll;
* `peer_kill_*`: the echo is SIGKILLed while the initiator streams WRITEs, each followed by
  a notification; how long until the initiator sees an error (None: not within
  `kill_timeout_s`), and how. `peer_kill_notif_*`: the same with notifications only (what a
  waiting D sends a P that has not granted its request yet: heartbeats).

Each side runs in its own process so that whatever UCX does when a peer dies cannot take the
benchmark down with it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfsm.cli.render import figures_table
from kvfsm.fabric import UCX_ERROR_HANDLING_MODES, UcxErrorHandling

__all__ = ["XFER_BYTES", "bench_notifications", "measure_mode"]

XFER_BYTES = 16 * 1024
"""The small transfer's size (a few KV blocks' worth of a small model)."""
_WARMUP = 50  # exchanges before timing: UCX wires connections up lazily
_BOUND_S = 120.0  # any one wait for the other process
_KILL_AFTER = 50  # WRITEs streamed before the echo is killed
_STREAM_POLL_S = 1e-3


def bench_notifications(samples: int = 2000, kill_timeout_s: float = 5.0) -> dict[str, Any]:
    """Every figure for both modes, keys suffixed by the mode (`notify_rtt_us_p50_peer`, ...)."""
    out: dict[str, Any] = {"samples": samples, "xfer_bytes": XFER_BYTES}
    for mode in UCX_ERROR_HANDLING_MODES:
        figures = measure_mode(mode, samples, kill_timeout_s)
        notif_only = measure_mode(mode, 0, kill_timeout_s, kill_with_writes=False)
        figures.update({k.replace("kill_", "kill_notif_"): v for k, v in notif_only.items()})
        out.update({f"{k}_{mode}": v for k, v in figures.items()})
    return out


def measure_mode(
    mode: UcxErrorHandling, samples: int, kill_timeout_s: float, *, kill_with_writes: bool = True
) -> dict[str, Any]:
    """One mode's figures (none with `samples=0`) and what a killed echo does: echo and
    initiator in processes of their own."""
    ctx = mp.get_context("spawn")
    e_conn, e_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    echo = ctx.Process(target=_echo_main, args=(mode, e_child), daemon=True)
    initiator = ctx.Process(
        target=_initiator_main,
        args=(mode, samples, kill_timeout_s, kill_with_writes, i_child),
        daemon=True,
    )
    echo.start()
    initiator.start()
    try:
        i_conn.send(_recv(e_conn, "echo"))  # its metadata, buffer address and pid
        e_conn.send(_recv(i_conn, "initiator"))  # the initiator's metadata
        i_conn.send(_recv(e_conn, "echo"))  # the echo loaded it and polls
        result: dict[str, Any] = dict(_recv(i_conn, "initiator"))
        try:
            result.update(_recv(i_conn, "initiator", kill_timeout_s + _BOUND_S))
            result["peer_kill_initiator_survived"] = True
        except EOFError:  # the initiator died with its peer
            result["peer_kill_initiator_survived"] = False
        return result
    finally:
        for proc in (initiator, echo):
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _recv(conn: Connection, who: str, timeout: float = _BOUND_S) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"the {who} process did not answer in {timeout}s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(f"the {who} process failed: {msg[1]}")
    return msg


# --- the echo process ------------------------------------------------------------------------


def _echo_main(mode: UcxErrorHandling, conn: Connection) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvfsm.fabric import NixlFabric

    try:
        fabric = NixlFabric("bench-echo", ucx_error_handling=mode)
        buf = np.zeros(XFER_BYTES, dtype=np.uint8)
        fabric.register_memory(buf)
        conn.send((fabric.get_agent_metadata(), int(buf.ctypes.data), os.getpid()))
        peer = fabric.add_remote_agent(conn.recv())
        conn.send("ready")
        _echo(fabric, peer, buf)
        fabric.close()
    except Exception as exc:  # report, the driver fails the run saying why
        conn.send(("error", repr(exc)))


def _echo(fabric: Any, peer: str, buf: npt.NDArray[np.uint8]) -> None:
    """Answer pings ("p" -> "q"), WRITE notifications ("x<i>" -> "a<ns> <ok>") and poll
    interval changes ("i<us>") until "s"."""
    interval = 0.0
    while True:
        for msg in fabric.get_new_notifs().get(peer, []):
            kind, body = msg[:1], msg[1:]
            if kind == b"s":
                return
            if kind == b"p":
                fabric.send_notif(peer, b"q" + body)
            elif kind == b"x":
                now = time.monotonic_ns()
                ok = int(buf[0]) == int(buf[-1]) == int(body) % 256
                fabric.send_notif(peer, b"a%d %d" % (now, ok))
            elif kind == b"i":
                interval = int(body) * 1e-6
        if interval:
            time.sleep(interval)


# --- the initiator process ---------------------------------------------------------------------


class _Initiator:
    """The measuring side: one WRITE-able 16 KiB buffer on each agent."""

    def __init__(self, mode: UcxErrorHandling, conn: Connection) -> None:
        from kvfsm.fabric import NixlFabric

        self.fabric = NixlFabric("bench-initiator", ucx_error_handling=mode)
        self.src = np.zeros(XFER_BYTES, dtype=np.uint8)
        self.fabric.register_memory(self.src)
        meta, addr, self.echo_pid = conn.recv()
        self.peer = self.fabric.add_remote_agent(meta)
        conn.send(self.fabric.get_agent_metadata())
        conn.recv()  # the echo is ready
        self.local = self.fabric.prep_xfer_dlist(None, _row(int(self.src.ctypes.data)))
        self.remote = self.fabric.prep_xfer_dlist(self.peer, _row(addr))
        self.idx = np.zeros(1, dtype=np.int64)

    def await_reply(self, kind: bytes) -> bytes:
        """Poll until the echo's next message of `kind` (one exchange is outstanding at most)."""
        deadline = time.monotonic() + _BOUND_S
        while time.monotonic() < deadline:
            for msg in self.fabric.get_new_notifs().get(self.peer, []):
                if msg[:1] == kind:
                    return bytes(msg)
        raise TimeoutError(f"no {kind!r} from the echo in {_BOUND_S}s")

    def write(self, i: int) -> int:
        """WRITE the buffer (every byte `i % 256`) with notification `x<i>`; wait for DONE;
        return when `transfer()` was called (monotonic ns)."""
        self.src[:] = i % 256
        f = self.fabric
        h = f.make_prepped_xfer("WRITE", self.local, self.idx, self.remote, self.idx, b"x%d" % i)
        t0 = time.monotonic_ns()
        state = f.transfer(h)
        deadline = time.monotonic() + _BOUND_S
        while state == "PROC" and time.monotonic() < deadline:
            state = f.check_xfer_state(h)
        f.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"a WRITE ended {state}")
        return t0


def _row(addr: int) -> npt.NDArray[np.int64]:
    return np.array([[addr, XFER_BYTES, 0]], dtype=np.int64)


def _initiator_main(
    mode: UcxErrorHandling, samples: int, kill_timeout_s: float, writes: bool, conn: Connection
) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        me = _Initiator(mode, conn)
        figures: dict[str, Any] = {}
        if samples > 0:
            figures.update(_rtt(me, samples))
            figures.update(_writes(me, samples))
            figures.update(_stream(me, max(100, samples // 10)))
        else:  # only wire the connection up
            _rtt(me, 1)
        conn.send(figures)
        conn.send(_kill(me, kill_timeout_s, writes))
    except Exception as exc:  # report, the driver fails the run saying why
        conn.send(("error", repr(exc)))


def _pct(values_us: list[float], name: str) -> dict[str, float]:
    arr = np.asarray(values_us)
    return {
        f"{name}_p50": round(float(np.percentile(arr, 50)), 2),
        f"{name}_p99": round(float(np.percentile(arr, 99)), 2),
    }


def _rtt(me: _Initiator, samples: int) -> dict[str, Any]:
    rtts: list[float] = []
    for i in range(_WARMUP + samples):
        t0 = time.perf_counter_ns()
        me.fabric.send_notif(me.peer, b"p%d" % i)
        me.await_reply(b"q")
        if i >= _WARMUP:
            rtts.append((time.perf_counter_ns() - t0) / 1e3)
    return _pct(rtts, "notify_rtt_us")


def _writes(me: _Initiator, samples: int) -> dict[str, Any]:
    """WRITE-and-answer exchanges: post-to-notified latency, exchanges per second, bytes."""
    lat: list[float] = []
    wrong = 0
    for i in range(_WARMUP):
        me.write(i)
        me.await_reply(b"a")
    t0 = time.perf_counter()
    for i in range(samples):
        posted = me.write(i)
        arrived, ok = me.await_reply(b"a")[1:].split()
        lat.append((int(arrived) - posted) / 1e3)
        wrong += ok != b"1"
    wall = time.perf_counter() - t0
    return {
        **_pct(lat, "xfer_notified_us"),
        "pingpong_rps": round(samples / wall),
        "xfer_wrong": wrong,
    }


def _stream(me: _Initiator, n: int) -> dict[str, Any]:
    """Notification, then WRITE until DONE, `n` times, while the echo polls every 1 ms."""
    me.fabric.send_notif(me.peer, b"i%d" % round(_STREAM_POLL_S * 1e6))
    me.fabric.send_notif(me.peer, b"p-1")
    me.await_reply(b"q")  # the echo took the new interval
    t0 = time.perf_counter()
    for i in range(n):
        me.fabric.send_notif(me.peer, b"h")  # kvfsm's control messages travel between WRITEs
        me.write(i)
    wall = time.perf_counter() - t0
    me.fabric.send_notif(me.peer, b"i0")
    me.fabric.send_notif(me.peer, b"p-2")
    me.await_reply(b"q")
    me.fabric.get_new_notifs()  # the WRITEs' answers
    return {"stream_rps_poll1ms": round(n / wall)}


def _kill(me: _Initiator, timeout_s: float, writes: bool) -> dict[str, Any]:
    """Stream WRITEs, each followed by a notification (or notifications only, 1 ms apart),
    SIGKILL the echo after `_KILL_AFTER` of them, and keep streaming until the initiator sees
    an error or `timeout_s` passed."""
    from kvfsm.fabric import FabricError

    f = me.fabric
    killed_at: float | None = None
    posted, handle, state = 0, None, "DONE"
    while killed_at is None or time.monotonic() - killed_at < timeout_s:
        if killed_at is None and posted >= _KILL_AFTER:
            os.kill(me.echo_pid, signal.SIGKILL)
            killed_at = time.monotonic()
        try:
            if not writes:
                f.send_notif(me.peer, b"h")
                f.get_new_notifs()
                posted += 1
                time.sleep(_STREAM_POLL_S)
                continue
            if handle is None:
                handle = f.make_prepped_xfer("WRITE", me.local, me.idx, me.remote, me.idx, b"x0")
                state = f.transfer(handle)
                f.send_notif(me.peer, b"h")
            else:
                state = f.check_xfer_state(handle)
            f.get_new_notifs()
        except FabricError as exc:
            return _detected(killed_at, type(exc).__name__, posted)
        if state == "ERR":
            return _detected(killed_at, "ERR", posted)
        if state == "DONE" and handle is not None:
            f.release_xfer_handle(handle)
            handle, posted = None, posted + 1
    what = "WRITEs stay PROC" if state == "PROC" else "WRITEs end DONE"
    how = f"nothing in {timeout_s:g}s: {what if writes else 'notifications still accepted'}"
    return {"peer_kill_detected_s": None, "peer_kill_how": how, "peer_kill_posted": posted}


def _detected(killed_at: float | None, how: str, posted: int) -> dict[str, Any]:
    after = None if killed_at is None else round(time.monotonic() - killed_at, 6)
    return {"peer_kill_detected_s": after, "peer_kill_how": how, "peer_kill_posted": posted}


def main(argv: list[str] | None = None) -> None:
    """Print the figures (as JSON with `--json`)."""
    parser = argparse.ArgumentParser(prog="benchmarks/ucx_notify.py", description=__doc__)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--kill-timeout-s", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    figures = bench_notifications(args.samples, args.kill_timeout_s)
    figures_table("notifications: UCX error handling peer vs none", figures, as_json=args.json)


if __name__ == "__main__":
    main()
