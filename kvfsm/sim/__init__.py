"""The simulated cluster: P and D engines in one process on the simulated fabric (or real NIXL
agents), driven step by step, with the six safety properties checked as they run (`Ledger`,
`Conformance`), the lockstep twin of sim and NIXL, small geometries and bounds for fast runs,
and recognisable KV contents checkable on any rank of any geometry.

`kvfsm check`, `kvfsm scenario`, `kvfsm demo --fabric sim` and the test tools run on it."""

from kvfsm.sim._cluster import Cluster, PairedRequest
from kvfsm.sim._invariants import COVERAGE, Conformance, Ledger, LedgerBooks, untaken_transitions
from kvfsm.sim._lockstep import LockstepCluster
from kvfsm.sim._losses import LossyInbox, message_kind
from kvfsm.sim._pattern import PatternCheck, check_request, request_seed, write_request
from kvfsm.sim._presets import FAST_CONFIG, SMALL_GEOMETRY, SMALL_MLA_GEOMETRY

__all__ = [
    "COVERAGE",
    "FAST_CONFIG",
    "SMALL_GEOMETRY",
    "SMALL_MLA_GEOMETRY",
    "Cluster",
    "Conformance",
    "Ledger",
    "LedgerBooks",
    "LockstepCluster",
    "LossyInbox",
    "PairedRequest",
    "PatternCheck",
    "check_request",
    "message_kind",
    "request_seed",
    "untaken_transitions",
    "write_request",
]
