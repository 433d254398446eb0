"""The runtime: engines that drive the core and execute its commands on a fabric."""

from kvfsm.runtime._directory import DirectoryView, LocalDirectory
from kvfsm.runtime._engine import (
    CallerOutput,
    Directory,
    Engine,
    HandshakeError,
    InFlight,
    PeerInfo,
)

__all__ = [
    "CallerOutput",
    "Directory",
    "DirectoryView",
    "Engine",
    "HandshakeError",
    "InFlight",
    "LocalDirectory",
    "PeerInfo",
]
