"""Test tools over the simulated cluster (`kvfsm.sim`): a scripted tour of interleavings random
search rarely reaches, driving a request to any live state, and free loopback ports. The
hypothesis state machines are `kvfsm.testing.stateful` and `kvfsm.testing.twin` (they need
hypothesis, which nothing else here does)."""

from kvfsm.testing._ports import free_port
from kvfsm.testing._states import abandon_in, drive_to, live_states
from kvfsm.testing._tour import INTERLEAVINGS, run_tour

__all__ = [
    "INTERLEAVINGS",
    "abandon_in",
    "drive_to",
    "free_port",
    "live_states",
    "run_tour",
]
