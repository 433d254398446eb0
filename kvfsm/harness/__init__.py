"""Processes for the commands, the benchmarks and the tests: one engine rank in a process of its
own on real NIXL and ZMQ (`rank_main`, `open_rank`), the driver's side of such ranks
(`RankProcesses`), whether their buffers fit in this host's memory (`require_memory`), two hosts on one machine (network namespaces joined by a veth pair), and
vLLM engines in processes (`kvfsm.harness.vllm_pd`, imported on its own)."""

from kvfsm.harness._host import available_memory, require_memory
from kvfsm.harness._netns import (
    Host,
    NetnsError,
    NetnsPair,
    netns_main,
    remove_leftovers,
    ucx_env,
)
from kvfsm.harness._processes import START_S, RankMain, RankProcesses
from kvfsm.harness._rank import (
    HANDSHAKE_TIMEOUT_S,
    LoopFactory,
    Rank,
    RankLoop,
    RankSpec,
    close_rank,
    open_rank,
    rank_main,
)

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "START_S",
    "Host",
    "LoopFactory",
    "NetnsError",
    "NetnsPair",
    "Rank",
    "RankLoop",
    "RankMain",
    "RankProcesses",
    "RankSpec",
    "available_memory",
    "close_rank",
    "netns_main",
    "open_rank",
    "rank_main",
    "remove_leftovers",
    "require_memory",
    "ucx_env",
]
