"""Two "hosts" on one machine: two Linux network namespaces joined by a veth pair.

For tests that need P and D to talk over a real network link that can be cut: each side runs in
a process that entered its own namespace (`netns_main`) before it made any socket or NIXL agent,
so its UCX (over TCP, on its veth end only: `ucx_env`) and ZMQ traffic crosses the veth. The
root namespace keeps control of the link: `NetnsPair.cut` sets both ends down, `restore` brings
them back, `limit` slows the link (a token bucket, `tc ... tbf`) so that a transfer is really in
flight when it is cut.

Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2; anything missing
raises `NetnsError` saying exactly what, for a test to fail on (never to skip).

Names carry the creating process's id (`kvfsm-<pid>-<n>-a`), so concurrent runs never collide and
the namespaces of a crashed earlier run (its process gone) are recognised and deleted.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = [
    "CLONE_NEWNET",
    "PREFIX",
    "Host",
    "NetnsError",
    "NetnsPair",
    "enter_netns",
    "netns_main",
    "remove_leftovers",
    "ucx_env",
]

CLONE_NEWNET = 0x40000000
"""`setns`'s namespace type for a network namespace (linux/sched.h)."""
PREFIX = "kvfsm"
"""The default start of the namespaces' names."""
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2  # linux/mount.h
_NETNS_DIR = "/run/netns"  # where `ip netns add` bind-mounts each namespace
_IP_TIMEOUT_S = 30.0  # one iproute2 call; they take milliseconds
_numbers = itertools.count()


class NetnsError(RuntimeError):
    """Network namespaces could not be set up, torn down or entered; the message says why."""


@dataclass(frozen=True)
class Host:
    """One end of the link: a namespace, its veth device and that device's IPv4 address."""

    netns: str
    device: str
    address: str


TCP_USER_TIMEOUT = "1s"
"""The kernel drops a connection whose data stays unacknowledged this long (UCX_TCP_USER_TIMEOUT):
short, so that D's hold of given-up blocks (this plus `TCP_DRAIN_SLACK_S`) keeps the tests short."""


def ucx_env(host: Host) -> dict[str, str]:
    """The environment that makes UCX move everything over TCP on `host`'s veth (without it,
    UCX would find the peer on the same machine and copy through shared memory or CMA, never
    touching the link), with `TCP_USER_TIMEOUT`."""
    return {
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": host.device,
        "UCX_TCP_USER_TIMEOUT": TCP_USER_TIMEOUT,
    }


def _run(args: Sequence[str], what: str) -> str:
    """Run one iproute2 command; `NetnsError` naming the command and its complaint if it fails."""
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{what}: `{' '.join(args)}` could not run: {exc!r}") from exc
    if done.returncode != 0:
        raise NetnsError(
            f"{what}: `{' '.join(args)}` exited {done.returncode}: {done.stderr.strip()}"
        )
    return done.stdout


def _check_prerequisites(need_tc: bool) -> None:
    """Fail early, naming the missing piece, instead of with a confusing iproute2 error."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        euid = os.geteuid() if hasattr(os, "geteuid") else "unknown"
        raise NetnsError(
            f"network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN); this process runs "
            f"with effective uid {euid}"
        )
    tools = ["ip", "tc"] if need_tc else ["ip"]
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"iproute2 is not installed: {', '.join(missing)} not found on PATH")


def _owner_pid(name: str, prefix: str) -> int | None:
    """The pid in a namespace name made by `NetnsPair` with `prefix`, else None."""
    parts = name[len(prefix) + 1 :].split("-") if name.startswith(prefix + "-") else []
    return int(parts[0]) if len(parts) == 3 and parts[0].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces a crashed earlier run with `prefix` left behind (those whose
    creating process is gone; a live run's are kept); returns their names."""
    try:
        names = sorted(os.listdir(_NETNS_DIR))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        pid = _owner_pid(name, prefix)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            _run(["ip", "netns", "delete", name], "removing a leftover namespace")
            removed.append(name)
    return removed


class NetnsPair:
    """Two namespaces, `a` and `b`, joined by a veth pair with `subnet`.1/24 and .2/24.

    Use as a context manager (or call `close`): the namespaces, and with them the veth pair and
    its qdiscs, are deleted however the body ends.
    """

    def __init__(self, prefix: str = PREFIX, subnet: str = "10.77.0", *, tc: bool = True) -> None:
        """`tc`: also require `tc` (for `limit`)."""
        _check_prerequisites(need_tc=tc)
        remove_leftovers(prefix)
        stem = f"{prefix}-{os.getpid()}-{next(_numbers)}"
        self.a = Host(f"{stem}-a", "veth-a", f"{subnet}.1")
        self.b = Host(f"{stem}-b", "veth-b", f"{subnet}.2")
        self._made: list[str] = []
        self._limited = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for host in (self.a, self.b):
            _run(["ip", "netns", "add", host.netns], "creating a network namespace")
            self._made.append(host.netns)
        # Created directly inside the namespaces: nothing is left in the root namespace even if
        # this run dies, and the device names cannot collide with another run's.
        _run(
            [
                "ip",
                "link",
                "add",
                self.a.device,
                "netns",
                self.a.netns,
                "type",
                "veth",
                "peer",
                "name",
                self.b.device,
                "netns",
                self.b.netns,
            ],
            "creating the veth pair",
        )
        for host in (self.a, self.b):
            self._ip(host, "addr", "add", f"{host.address}/24", "dev", host.device)
            self._ip(host, "link", "set", "lo", "up")
            self._ip(host, "link", "set", host.device, "up")

    def _ip(self, host: Host, *args: str) -> str:
        return _run(["ip", "-n", host.netns, *args], f"configuring {host.netns}")

    def cut(self) -> None:
        """Set both veth ends down: every packet either way is dropped (the route goes too, so
        new connections fail with 'network unreachable'), as when a cable is pulled."""
        for host in (self.a, self.b):
            self._ip(host, "link", "set", host.device, "down")

    def restore(self) -> None:
        """Bring both ends up again (the kernel restores the subnet's route with the link)."""
        for host in (self.a, self.b):
            self._ip(host, "link", "set", host.device, "up")

    def limit(self, rate: str) -> None:
        """Slow both directions to `rate` (tc syntax, e.g. "8mbit") with a token bucket."""
        self._limited = True
        for host in (self.a, self.b):
            _run(
                [
                    "tc",
                    "-n",
                    host.netns,
                    "qdisc",
                    "replace",
                    "dev",
                    host.device,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "32kbit",
                    "latency",
                    "100ms",
                ],
                f"limiting the link in {host.netns}",
            )

    def unlimit(self) -> None:
        """Remove the rate limit, if any."""
        if not self._limited:
            return
        self._limited = False
        for host in (self.a, self.b):
            _run(
                ["tc", "-n", host.netns, "qdisc", "del", "dev", host.device, "root"],
                f"unlimiting the link in {host.netns}",
            )

    def tx_bytes(self, host: Host) -> int:
        """Bytes `host`'s veth end has sent so far."""
        (link,) = json.loads(self._ip(host, "-j", "-s", "link", "show", "dev", host.device))
        return int(link["stats64"]["tx"]["bytes"])

    def close(self) -> None:
        """Delete both namespaces (idempotent); `NetnsError` if one could not be deleted."""
        problems = []
        while self._made:
            name = self._made.pop()
            try:
                _run(["ip", "netns", "delete", name], "deleting a network namespace")
            except NetnsError as exc:
                problems.append(str(exc))
        if problems:
            raise NetnsError("; ".join(problems))

    def __enter__(self) -> NetnsPair:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def enter_netns(netns: str) -> None:
    """Move the calling process into network namespace `netns` as `ip netns exec` does (Python
    3.11 has no `os.setns`): join it, then give the process a mount namespace of its own with
    /sys mounted afresh, since sysfs shows the devices of the namespace that mounted it and UCX
    finds its network devices in /sys/class/net. Call it before the process makes threads or
    sockets: threads made later inherit the namespace, earlier ones and their sockets do not
    (and `unshare` of the mount namespace refuses a process with several threads)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(os.path.join(_NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NetnsError(f"cannot open namespace {netns!r}: {exc}") from exc
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns into {netns!r}")
    finally:
        os.close(fd)
    _check(libc.unshare(_CLONE_NEWNS), "unshare of the mount namespace")
    # Keep our mounts from propagating back to the root namespace's, then replace /sys.
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "making / a slave mount")
    _check(libc.umount2(b"/sys", _MNT_DETACH), "unmounting /sys")
    _check(libc.mount(netns.encode(), b"/sys", b"sysfs", 0, None), "mounting sysfs on /sys")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"{what} failed: {os.strerror(err)} (errno {err})")


def netns_main(netns: str, env: dict[str, str], target: Callable[..., Any], *args: Any) -> None:
    """A `multiprocessing` (spawn) target: enter `netns`, set `env`, then run `target(*args)`.
    Pipes inherited from the parent are file descriptors, which a namespace change keeps."""
    enter_netns(netns)
    os.environ.update(env)
    target(*args)
