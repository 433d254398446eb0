"""The runtime: engines that drive the core and execute its commands on a fabric, and the
handshake contract (`PeerInfo`, `HandshakeError`, `Directory`) the side channel implements."""

from kvfsm.runtime._conformance import Conformance
from kvfsm.runtime._engine import CallerOutput, Engine, InFlight
from kvfsm.runtime._guests import MAX_GUESTS, Guests
from kvfsm.runtime._handshake import Directory, HandshakeError, PeerInfo, StatusQuery
from kvfsm.runtime._integrity import (
    Checksum,
    corrupt_after_checksum,
    corrupt_bytes_after_checksum,
    kv_checksum,
)
from kvfsm.runtime._kv import KvCache
from kvfsm.runtime._loop import EngineLoop, LoopCalls, status_answerer
from kvfsm.runtime._routes import Route, plan_route
from kvfsm.runtime._trace import RequestTrace, TransferStats, time_in_state

__all__ = [
    "MAX_GUESTS",
    "CallerOutput",
    "Checksum",
    "Conformance",
    "Directory",
    "Engine",
    "EngineLoop",
    "Guests",
    "HandshakeError",
    "InFlight",
    "KvCache",
    "LoopCalls",
    "PeerInfo",
    "RequestTrace",
    "Route",
    "StatusQuery",
    "TransferStats",
    "corrupt_after_checksum",
    "corrupt_bytes_after_checksum",
    "kv_checksum",
    "plan_route",
    "status_answerer",
    "time_in_state",
]
