"""Fabrics: the `Fabric` protocol and its implementations."""

from kvfsm.fabric._memory import BufferSpan, buffer_span
from kvfsm.fabric._nixl import (
    TCP_DRAIN_SLACK_S,
    TCP_USER_TIMEOUT_DEFAULT,
    UCX_DEFAULTS,
    UCX_ERROR_HANDLING_DEFAULT,
    UCX_ERROR_HANDLING_MODES,
    NixlFabric,
    UcxErrorHandling,
    nixl_api,
    tcp_late_delivery_s,
)
from kvfsm.fabric._protocol import (
    DescArray,
    DlistHandle,
    Fabric,
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
from kvfsm.fabric._sim import SimFabric, SimNetwork
from kvfsm.fabric._sim_clock import NetworkSnapshot
from kvfsm.fabric._sim_faults import SimFaults, SimStats

__all__ = [
    "TCP_DRAIN_SLACK_S",
    "TCP_USER_TIMEOUT_DEFAULT",
    "UCX_DEFAULTS",
    "UCX_ERROR_HANDLING_DEFAULT",
    "UCX_ERROR_HANDLING_MODES",
    "BufferSpan",
    "DescArray",
    "DlistHandle",
    "Fabric",
    "FabricError",
    "MemoryHandle",
    "NetworkSnapshot",
    "NixlFabric",
    "NotFoundError",
    "RemoteDisconnectedError",
    "RepostError",
    "SimFabric",
    "SimFaults",
    "SimNetwork",
    "SimStats",
    "UcxErrorHandling",
    "XferHandle",
    "XferOp",
    "XferState",
    "XferTelemetry",
    "buffer_span",
    "nixl_api",
    "tcp_late_delivery_s",
]
