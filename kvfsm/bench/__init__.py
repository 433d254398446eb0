"""What `kvfsm bench` measures, as a library: raw NIXL (vLLM's way and kvfsm's settings), the
engine on the same descriptors in rank processes, memcpy, the control plane alone, and host or
device memory for the buffers. `kvfsm.cli` keeps only the command's arguments and its tables;
the scripts in benchmarks/ import these names."""

from kvfsm.bench._control import (
    control_bench,
    core_wave,
    engine_wave,
    make_engines,
    memory_per_request,
)
from kvfsm.bench._engine import HOPS, bench_geometry, handoff_hops, run_engine_variant
from kvfsm.bench._memory import MEMORIES, Memory, allocate, copy_gbps, on_host, unavailable
from kvfsm.bench._raw import (
    BenchPlan,
    RawInitiator,
    Variant,
    buffer_of,
    check_sink,
    churned_free_queue,
    gbps,
    kv_buffer,
    memcpy_gbps,
    plan_requests,
    recv_bounded,
    run_pair,
    run_variant,
    serve_target,
)
from kvfsm.bench._run import (
    DEFAULT_VARIANTS,
    LAYOUTS,
    VARIANTS,
    BenchOptions,
    run_bench,
    steps,
)

__all__ = [
    "DEFAULT_VARIANTS",
    "HOPS",
    "LAYOUTS",
    "MEMORIES",
    "VARIANTS",
    "BenchOptions",
    "BenchPlan",
    "Memory",
    "RawInitiator",
    "Variant",
    "allocate",
    "bench_geometry",
    "buffer_of",
    "check_sink",
    "churned_free_queue",
    "control_bench",
    "copy_gbps",
    "core_wave",
    "engine_wave",
    "gbps",
    "handoff_hops",
    "kv_buffer",
    "make_engines",
    "memcpy_gbps",
    "memory_per_request",
    "on_host",
    "plan_requests",
    "recv_bounded",
    "run_bench",
    "run_engine_variant",
    "run_pair",
    "run_variant",
    "serve_target",
    "steps",
    "unavailable",
]
