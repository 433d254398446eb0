"""Fabrics: the `Fabric` protocol and its implementations."""

from kvfsm.fabric._nixl import NixlFabric, nixl_api
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
)
from kvfsm.fabric._sim import SimFabric, SimNetwork
from kvfsm.fabric._sim_faults import SimFaults, SimStats

__all__ = [
    "DescArray",
    "DlistHandle",
    "Fabric",
    "FabricError",
    "MemoryHandle",
    "NixlFabric",
    "NotFoundError",
    "RemoteDisconnectedError",
    "RepostError",
    "SimFabric",
    "SimFaults",
    "SimNetwork",
    "SimStats",
    "XferHandle",
    "XferOp",
    "XferState",
    "nixl_api",
]
