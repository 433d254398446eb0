"""Public test tools: a simulated P/D cluster with the safety properties checked, the hypothesis
state machine over it, the bounded exhaustive check over it (`kvfsm check`), scenario files
replayed on it, the transition coverage report, and recognisable KV contents checkable on any
rank of any geometry."""

from kvfsm.testing._check import MAX_DEPTH, CheckReport, CheckViolation
from kvfsm.testing._check_search import default_workers, run_check
from kvfsm.testing._cluster import (
    FAST_CONFIG,
    SIM_GEOMETRY,
    SIM_MLA_GEOMETRY,
    PairedRequest,
    SimCluster,
)
from kvfsm.testing._invariants import COVERAGE, Conformance, Ledger, untaken_transitions
from kvfsm.testing._pattern import PatternCheck, check_request, request_seed, write_request
from kvfsm.testing._ports import free_port
from kvfsm.testing._scenario import ScenarioReport, run_scenario
from kvfsm.testing._scenario_file import Scenario, ScenarioError, load_scenario
from kvfsm.testing._stateful import LifecycleMachine, machine_for
from kvfsm.testing._tour import SCENARIOS, run_tour

__all__ = [
    "COVERAGE",
    "FAST_CONFIG",
    "MAX_DEPTH",
    "SCENARIOS",
    "SIM_GEOMETRY",
    "SIM_MLA_GEOMETRY",
    "CheckReport",
    "CheckViolation",
    "Conformance",
    "Ledger",
    "LifecycleMachine",
    "PairedRequest",
    "PatternCheck",
    "Scenario",
    "ScenarioError",
    "ScenarioReport",
    "SimCluster",
    "check_request",
    "default_workers",
    "free_port",
    "load_scenario",
    "machine_for",
    "request_seed",
    "run_check",
    "run_scenario",
    "run_tour",
    "untaken_transitions",
    "write_request",
]
