"""`NixlFabric`: the `Fabric` protocol on a real NIXL agent (UCX backend, DRAM).

NIXL is not thread-safe: one thread must own a `NixlFabric` and make every call. The agent is
created without NIXL's progress thread (it busy-polls a core, which on small machines made
transfers 3-8x slower); progress is driven by the owner's own `check_xfer_state` and
`get_new_notifs` calls. NIXL's typed exceptions become kvfsm's `FabricError` subclasses.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from kvfsm.fabric._memory import buffer_span
from kvfsm.fabric._protocol import (
    DescArray,
    DlistHandle,
    FabricError,
    MemoryHandle,
    NotFoundError,
    RemoteDisconnectedError,
    RepostError,
    XferHandle,
    XferOp,
    XferState,
    XferTelemetry,
)

__all__ = [
    "TCP_DRAIN_SLACK_S",
    "TCP_USER_TIMEOUT_DEFAULT",
    "UCX_DEFAULTS",
    "UCX_ERROR_HANDLING_DEFAULT",
    "UCX_ERROR_HANDLING_MODES",
    "NixlFabric",
    "UcxErrorHandling",
    "nixl_api",
    "tcp_late_delivery_s",
]

_LOCAL = "NIXL_INIT_AGENT"  # NIXL's name for "my own memory" in prep_xfer_dlist
UcxErrorHandling = Literal["peer", "none"]
"""UCX's `ucx_error_handling_mode`: "peer" detects a failed peer, "none" does not (and so can
carry notifications over shared memory)."""
UCX_ERROR_HANDLING_MODES: tuple[UcxErrorHandling, ...] = ("peer", "none")
UCX_ERROR_HANDLING_DEFAULT: UcxErrorHandling = "peer"
"""kvfsm's choice, from the figures in docs/runtime.md."""
T = TypeVar("T")

TCP_USER_TIMEOUT_DEFAULT = "10s"
"""`UCX_TCP_USER_TIMEOUT` where the environment sets none: over UCX's TCP transport the kernel
drops a connection whose data stays unacknowledged this long, and with it the bytes of transfers
given up on (released handles do not recall bytes already in the socket). Without it they wait
for the link for up to ~15 minutes of retries. 10 s is D's default stall bound: a link silent
that long has failed the transfers anyway (docs/security.md)."""
_UCX_DRAM = {"UCX_TCP_USER_TIMEOUT": TCP_USER_TIMEOUT_DEFAULT}
UCX_DEFAULTS: Mapping[str, Mapping[str, str]] = {
    "DRAM": _UCX_DRAM,
    # UCX turns READs over CUDA IPC off where NVML finds no active NVLink (one GPU, or PCIe-only
    # ones); READs of CUDA memory then go through host memory over TCP, pull 45 times slower
    # than push (docs/performance.md). Not set for DRAM: a UCX built without CUDA warns of the
    # unused variable.
    "VRAM": _UCX_DRAM | {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"},
}
"""By memory type, the UCX settings a `NixlFabric` puts in the environment where the user set
none: UCX reads them from there when the backend starts, and NIXL passes no others through."""
TCP_DRAIN_SLACK_S = 2.0
"""Added to the TCP user timeout: the kernel's retransmission timer checks it late by up to
an RTO, and what a returning link delivers before the timeout takes time to arrive."""
_UCX_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|ns|m|h)?\s*$")
_UNITS = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "m": 60.0, "h": 3600.0}


def tcp_late_delivery_s(env: Mapping[str, str] = os.environ) -> float:
    """How long a released transfer's bytes may still land given UCX's settings in `env`: 0 if
    `UCX_TLS` rules TCP out, else the TCP user timeout plus slack (`math.inf` for "inf")."""
    if not _tcp_possible(env.get("UCX_TLS", "")):
        return 0.0
    value = env.get("UCX_TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_DEFAULT).strip().lower()
    if value in ("inf", "infinity", "auto"):
        return math.inf
    match = _UCX_TIME.match(value)
    if match is None:
        raise ValueError(f"UCX_TCP_USER_TIMEOUT={value!r} is not a time UCX takes (e.g. 10s)")
    return float(match[1]) * _UNITS[match[2]] + TCP_DRAIN_SLACK_S


def _tcp_possible(tls: str) -> bool:
    """Whether UCX may pick its TCP transport under `UCX_TLS` ("" and "all": it may)."""
    tls = tls.strip()
    excluding = tls.startswith("^")
    names = {t.strip() for t in tls.lstrip("^").split(",") if t.strip()}
    if not names:
        return True
    return "tcp" not in names if excluding else bool(names & {"tcp", "all"})


def nixl_api() -> Any:
    """NIXL's Python API module: `nixl._api`, else the CUDA-variant packages' copies."""
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        _log_to_stderr()
        return api
    raise ImportError(
        "NIXL is not installed: pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"
    )


def _log_to_stderr() -> None:
    """NIXL's console log goes to stderr: its handler writes to whatever `sys.stdout` was when
    NIXL was first imported, which a `--json` command keeps for its JSON alone."""
    for handler in logging.getLogger("nixl").handlers:
        # Only NIXL's own console handler: others (a test runner's capture) stay as they are.
        if type(handler) is logging.StreamHandler and handler.stream in (
            sys.stdout,
            sys.__stdout__,
        ):
            handler.setStream(sys.stderr)


def _bindings(api: Any) -> Any:
    return importlib.import_module(api.__name__.rsplit(".", 1)[0] + "._bindings")


class NixlFabric:
    """One NIXL agent behind the `Fabric` protocol; handles are small integers."""

    def __init__(
        self,
        name: str,
        *,
        mem_type: str = "DRAM",
        progress_thread: bool = False,
        telemetry: bool = True,
        ucx_error_handling: UcxErrorHandling = UCX_ERROR_HANDLING_DEFAULT,
        agent: Any = None,
    ) -> None:
        """`mem_type` is "DRAM" (host memory) or "VRAM" (CUDA tensors); `telemetry` has NIXL time
        and count each transfer (`xfer_telemetry`); `ucx_error_handling` is UCX's peer-failure
        detection: "peer" (a dead peer's transfers and notifications fail with an error) or
        "none" (notifications over shared memory, several times faster; a dead peer is then
        noticed only by kvfsm's own deadlines: docs/runtime.md); `agent` replaces the NIXL
        agent (tests of what kvfsm passes to NIXL where no GPU is present)."""
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be DRAM or VRAM, not {mem_type!r}")
        if ucx_error_handling not in UCX_ERROR_HANDLING_MODES:
            raise ValueError(
                f"ucx_error_handling must be one of {UCX_ERROR_HANDLING_MODES}, "
                f"not {ucx_error_handling!r}"
            )
        self._name = name
        if agent is None:
            api = nixl_api()
            self._translated = _Translation(name, _error_map(_bindings(api)))
            config = api.nixl_agent_config(
                enable_prog_thread=progress_thread, capture_telemetry=telemetry, backends=[]
            )
            agent = api.nixl_agent(name, config)
            for key, value in UCX_DEFAULTS[mem_type].items():  # read when the backend starts
                os.environ.setdefault(key, value)
            # The UCX backend is created here, not by the config, to pass it init parameters.
            with self._translated:
                agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_handling})
        else:
            self._translated = _Translation(name, {})
        self._agent = agent
        self._late_delivery_s = tcp_late_delivery_s()
        self._mem_type = mem_type
        self._telemetry = telemetry
        self._ids = itertools.count(1)
        self._memory: dict[int, Any] = {}
        self._dlists: dict[int, Any] = {}
        self._xfers: dict[int, Any] = {}
        self._remotes: set[str] = set()

    @property
    def agent_name(self) -> str:
        """This agent's name."""
        return self._name

    @property
    def late_delivery_s(self) -> float:
        """0 if `UCX_TLS` rules TCP out, else UCX_TCP_USER_TIMEOUT plus `TCP_DRAIN_SLACK_S`: a
        released WRITE's (or READ reply's) bytes already in a kernel socket land when the link
        allows, until the kernel drops the connection."""
        return self._late_delivery_s

    @property
    def ucx_error_handling(self) -> str:
        """The UCX backend's error handling mode, as NIXL reports it ("" if not told)."""
        params: dict[str, str] = self._agent.get_backend_params("UCX")
        return params.get("ucx_error_handling_mode", "")

    def register_memory(self, buffer: npt.NDArray[np.uint8]) -> MemoryHandle:
        """Register a contiguous 1-D uint8 numpy buffer (DRAM), or a contiguous torch tensor:
        a CPU tensor as DRAM, a CUDA tensor as VRAM on its device."""
        addr, nbytes, device, mem_type = buffer_span(buffer)
        if mem_type != self._mem_type:
            raise TypeError(f"{self._name} transfers {self._mem_type}; this buffer is {mem_type}")
        descs = self._agent.get_reg_descs([(addr, nbytes, device, "")], mem_type)
        with self._translated:
            registered = self._agent.register_memory(descs)
        return self._keep(self._memory, registered)

    def deregister_memory(self, handle: MemoryHandle) -> None:
        """Deregister a buffer."""
        with self._translated:
            self._agent.deregister_memory(self._take(self._memory, handle))

    def get_agent_metadata(self) -> bytes:
        """This agent's metadata, for a peer's `add_remote_agent`."""
        meta: bytes = self._agent.get_agent_metadata()
        return meta

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its name."""
        with self._translated:
            name = self._agent.add_remote_agent(metadata)
        agent = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(agent)
        return agent

    def remove_remote_agent(self, agent: str) -> None:
        """Forget a peer."""
        self._remotes.discard(agent)
        with self._translated:
            self._agent.remove_remote_agent(agent)

    def prep_xfer_dlist(self, agent: str | None, descs: DescArray) -> DlistHandle:
        """Prepare a descriptor list of local memory (`agent=None`) or of a loaded peer's."""
        rows = np.ascontiguousarray(descs, dtype=np.int64)
        with self._translated:
            xfer_descs = self._agent.get_xfer_descs(rows, self._mem_type)
            dlist = self._agent.prep_xfer_dlist(agent or _LOCAL, xfer_descs, self._mem_type)
        return self._keep(self._dlists, dlist)

    def release_dlist_handle(self, handle: DlistHandle) -> None:
        """Release a prepared list."""
        with self._translated:
            self._agent.release_dlist_handle(self._take(self._dlists, handle))

    def make_prepped_xfer(
        self,
        op: XferOp,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int64],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int64],
        notif: bytes,
        *,
        merge: bool = True,
    ) -> XferHandle:
        """Create a transfer between rows of two prepared lists (NIXL merges rows adjacent on
        both sides, unless `merge` is False: for measuring what that merging is worth)."""
        with self._translated:
            xfer = self._agent.make_prepped_xfer(
                op,
                self._get(self._dlists, local),
                local_idx,
                self._get(self._dlists, remote),
                remote_idx,
                notif,
                skip_desc_merge=not merge,
            )
        return self._keep(self._xfers, xfer)

    def make_xfer(
        self, op: XferOp, local: DescArray, agent: str, remote: DescArray, notif: bytes
    ) -> XferHandle:
        """Create a transfer between descriptor rows given directly (`initialize_xfer`: no
        merging of adjacent rows)."""
        with self._translated:
            xfer = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(local, self._mem_type),
                self._agent.get_xfer_descs(remote, self._mem_type),
                agent,
                notif,
            )
        return self._keep(self._xfers, xfer)

    def transfer(self, handle: XferHandle) -> XferState:
        """Post a transfer."""
        with self._translated:
            return self._state(self._agent.transfer(self._get(self._xfers, handle)))

    def check_xfer_state(self, handle: XferHandle) -> XferState:
        """Progress and report a posted transfer."""
        with self._translated:
            return self._state(self._agent.check_xfer_state(self._get(self._xfers, handle)))

    def release_xfer_handle(self, handle: XferHandle) -> None:
        """Release a transfer (NIXL aborts one still in progress)."""
        with self._translated:
            self._agent.release_xfer_handle(self._take(self._xfers, handle))

    def xfer_telemetry(self, handle: XferHandle) -> XferTelemetry | None:
        """NIXL's measurement of a finished transfer (None with telemetry off)."""
        if not self._telemetry:
            return None
        with self._translated:
            t = self._agent.get_xfer_telemetry(self._get(self._xfers, handle))
        return XferTelemetry(
            float(t.postDuration), float(t.xferDuration), int(t.totalBytes), int(t.descCount)
        )

    def send_notif(self, agent: str, msg: bytes) -> None:
        """Send a notification to a loaded peer."""
        with self._translated:
            self._agent.send_notif(agent, msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender."""
        with self._translated:
            notifs: dict[Any, list[bytes]] = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in notifs.items()}

    def close(self) -> None:
        """Release every handle, list, peer and registration (errors are ignored: best effort)."""
        for table, release in (
            (self._xfers, self._agent.release_xfer_handle),
            (self._dlists, self._agent.release_dlist_handle),
            (self._memory, self._agent.deregister_memory),
        ):
            for handle in list(table.values()):
                _quietly(release, handle)
            table.clear()
        for agent in list(self._remotes):
            _quietly(self._agent.remove_remote_agent, agent)
        self._remotes.clear()

    def open_resources(self) -> dict[str, int]:
        """Counts of what this agent holds (for leak tests)."""
        return {
            "memory": len(self._memory),
            "dlists": len(self._dlists),
            "xfers": len(self._xfers),
            "remote_agents": len(self._remotes),
        }

    # --- helpers -------------------------------------------------------------------------------

    def _keep(self, table: dict[int, Any], obj: Any) -> int:
        handle = next(self._ids)
        table[handle] = obj
        return handle

    def _get(self, table: dict[int, Any], handle: int) -> Any:
        obj = table.get(handle)
        if obj is None:
            raise NotFoundError(f"unknown handle {handle} on agent {self._name!r}")
        return obj

    def _take(self, table: dict[int, Any], handle: int) -> Any:
        obj = self._get(table, handle)
        del table[handle]
        return obj

    @staticmethod
    def _state(state: str) -> XferState:
        if state in ("DONE", "PROC", "ERR"):
            return state  # type: ignore[return-value]
        raise FabricError(f"NIXL reported an unknown transfer state {state!r}")


class _Translation:
    """NIXL's exceptions as kvfsm's `FabricError` kinds, saying which agent raised them: a
    context manager made once per agent (cheaper than a generator-based one on every call)."""

    __slots__ = ("_errors", "_name")

    def __init__(self, name: str, errors: dict[str, type[FabricError]]) -> None:
        self._name, self._errors = name, errors

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        # NIXL raises its own types (and sometimes plain ones); ours and non-errors pass as is
        if exc is None or isinstance(exc, FabricError) or not isinstance(exc, Exception):
            return
        error = self._errors.get(type(exc).__name__, FabricError)
        raise error(f"{self._name}: {type(exc).__name__}: {exc}") from exc


def _error_map(bindings: Any) -> dict[str, type[FabricError]]:
    known = {
        "nixlRemoteDisconnectError": RemoteDisconnectedError,
        "nixlRepostActiveError": RepostError,
        "nixlNotFoundError": NotFoundError,
    }
    return {name: kind for name, kind in known.items() if hasattr(bindings, name)}


def _quietly(call: Callable[[T], object], arg: T) -> None:
    try:
        call(arg)
    except Exception:  # best-effort cleanup: nothing useful to do with it
        return
