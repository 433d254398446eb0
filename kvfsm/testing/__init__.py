"""Public test tools: a simulated P/D cluster with the safety properties checked, the hypothesis
state machine over it, and the transition coverage report."""

from kvfsm.testing._cluster import FAST_CONFIG, PairedRequest, SimCluster
from kvfsm.testing._invariants import COVERAGE, Conformance, Ledger, untaken_transitions
from kvfsm.testing._stateful import LifecycleMachine, machine_for
from kvfsm.testing._tour import SCENARIOS, run_tour

__all__ = [
    "COVERAGE",
    "FAST_CONFIG",
    "SCENARIOS",
    "Conformance",
    "Ledger",
    "LifecycleMachine",
    "PairedRequest",
    "SimCluster",
    "machine_for",
    "run_tour",
    "untaken_transitions",
]
