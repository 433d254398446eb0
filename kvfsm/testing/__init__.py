"""Public test tools: an in-process P/D cluster with the six safety properties checked as its
engines run (on the simulated fabric or real NIXL agents), the transition coverage report, a
scripted tour of interleavings random search rarely reaches, recognisable KV contents checkable
on any rank of any geometry, and free loopback ports. The hypothesis state machine over the
cluster is `kvfsm.testing.stateful` (it needs hypothesis, which nothing else here does)."""

from kvfsm.testing._cluster import (
    FAST_CONFIG,
    SMALL_GEOMETRY,
    SMALL_MLA_GEOMETRY,
    Cluster,
    PairedRequest,
)
from kvfsm.testing._invariants import COVERAGE, Conformance, Ledger, untaken_transitions
from kvfsm.testing._pattern import PatternCheck, check_request, request_seed, write_request
from kvfsm.testing._ports import free_port
from kvfsm.testing._states import abandon_in, drive_to, live_states
from kvfsm.testing._tour import INTERLEAVINGS, run_tour

__all__ = [
    "COVERAGE",
    "FAST_CONFIG",
    "INTERLEAVINGS",
    "SMALL_GEOMETRY",
    "SMALL_MLA_GEOMETRY",
    "Cluster",
    "Conformance",
    "Ledger",
    "PairedRequest",
    "PatternCheck",
    "abandon_in",
    "check_request",
    "drive_to",
    "free_port",
    "live_states",
    "request_seed",
    "run_tour",
    "untaken_transitions",
    "write_request",
]
