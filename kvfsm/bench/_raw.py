"""`kvfsm bench`, first part: raw NIXL posted vLLM's way and with the engine's agent settings,
against a memcpy of the same bytes (the anchors a1, a2 and d).

Two processes, as P and D would be: a passive *target* that registers its KV buffer and, at the
end, checks every byte it received (push) or served (pull, checked by the initiator), and an
*initiator* that loads the target's agent, prepares one descriptor per block per region (the
prepped path, as vLLM's connector posts) and posts every request's transfer with a bounded
number in flight. Both fill the source side from the same seed, so the sink can check each
transferred byte without shipping the data. Every transfer carries a notification, as the
engine's do: the target takes note of when it drained each one, so that raw NIXL's latency can
also be measured up to the moment the other side learns of the transfer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from kvfsm.bench._memory import Memory, allocate, copy_gbps, on_host
from kvfsm.core import Mode
from kvfsm.fabric import UcxErrorHandling, XferHandle, buffer_span

__all__ = [
    "BenchPlan",
    "RawInitiator",
    "Variant",
    "buffer_of",
    "check_sink",
    "churned_free_queue",
    "gbps",
    "kv_buffer",
    "memcpy_gbps",
    "plan_requests",
    "recv_bounded",
    "run_pair",
    "run_variant",
    "serve_target",
]

Variant = Literal["raw_vllm_style", "raw", "raw_unmerged"]
# (progress thread, telemetry, NIXL merges adjacent rows): NIXL's defaults, what kvfsm's engine
# runs, and the same without NIXL's merging (to show what that merging is worth).
_SETTINGS: dict[str, tuple[bool, bool, bool]] = {
    "raw_vllm_style": (True, False, True),
    "raw": (False, True, True),
    "raw_unmerged": (False, True, False),
}
_BOUND_S = 120.0
_TARGET_POLL_S = 0.0  # no sleep: the target drains as soon as it can, raw NIXL at its best
_REAP_S = 5.0  # a process whose sentinel fired has exited: reaping it takes no longer


class BenchPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The geometry and the requests: `src[i]` blocks move to `dst[i]` blocks in every region."""

    block_bytes: int
    num_blocks: int
    regions: int
    op: Literal["WRITE", "READ"]
    src: list[list[int]]
    dst: list[list[int]]
    inflight: int = 4
    seed: int = 0
    ucx_error_handling: UcxErrorHandling = "peer"
    """kvfsm's setting for its own variants; the vLLM-style anchor keeps NIXL's default."""
    memory: Memory = "dram"
    """Where both sides' KV caches are: host memory, or the CUDA device's."""
    blocks_first: bool = False
    """vLLM's BLHNC/BLNHC: every region's (layer's) page of a block lies together, blocks one
    after the other; False: LBHNC/LBNHC, each region its blocks back to back."""

    def error_handling(self, variant: str) -> UcxErrorHandling:
        """The UCX error handling mode a variant's agents run with."""
        return "peer" if variant == "raw_vllm_style" else self.ucx_error_handling

    @property
    def mode(self) -> Mode:
        """push (WRITE) or pull (READ)."""
        return "push" if self.op == "WRITE" else "pull"

    @property
    def mem_type(self) -> str:
        """NIXL's name for the plan's memory."""
        return self.memory.upper()

    @property
    def region_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def bytes_per_request(self) -> int:
        return len(self.src[0]) * self.block_bytes * self.regions

    def page_offset(
        self, region: npt.NDArray[np.int64], block: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Where a region's page of a block starts, from the start of the buffer."""
        if self.blocks_first:
            return (block * self.regions + region) * self.block_bytes
        return region * self.region_bytes + block * self.block_bytes

    def pages(self, buffer: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
        """`buffer` as (regions, blocks, page bytes), whatever the layout (a view)."""
        if self.blocks_first:
            return buffer.reshape(self.num_blocks, self.regions, self.block_bytes).swapaxes(0, 1)
        return buffer.reshape(self.regions, self.num_blocks, self.block_bytes)


Allocation = Literal["contiguous", "fragmented", "realistic"]
ALLOCATIONS: tuple[Allocation, ...] = ("contiguous", "fragmented", "realistic")


def plan_requests(
    *, requests: int, blocks: int, num_blocks: int, allocation: str, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Source and destination block ids per request, disjoint across requests on each side:
    consecutive runs (contiguous), drawn from a shuffled free list (fragmented, sorted), or taken
    in order from the free queue of an allocator after churn (realistic)."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, not {allocation!r}")
    if requests * blocks > num_blocks:
        raise ValueError(f"{requests} x {blocks} blocks do not fit in {num_blocks}")
    rng = np.random.default_rng(seed)
    sides = []
    for _ in range(2):
        if allocation == "contiguous":
            order = list(range(num_blocks))
        elif allocation == "fragmented":
            order = [int(b) for b in rng.permutation(num_blocks)]
        else:
            order = churned_free_queue(num_blocks, blocks, rng)
        rows = [order[i * blocks : (i + 1) * blocks] for i in range(requests)]
        sides.append([sorted(row) for row in rows] if allocation == "fragmented" else rows)
    return sides[0], sides[1]


def churned_free_queue(num_blocks: int, typical: int, rng: np.random.Generator) -> list[int]:
    """The free queue of a block pool like vLLM's after a while of serving: requests of 1 to
    2 x `typical` blocks take blocks from the head, and finished ones give theirs back to the
    tail (last block first, as vLLM frees), in random order of finishing."""
    free = deque(range(num_blocks))
    live: list[list[int]] = []
    for _ in range(8 * num_blocks // max(typical, 1)):
        size = int(rng.integers(1, 2 * typical + 1))
        if live and (len(free) < size or rng.random() < 0.5):
            free.extend(reversed(live.pop(int(rng.integers(len(live))))))
        else:
            live.append([free.popleft() for _ in range(size)])
    for i in rng.permutation(len(live)):
        free.extend(reversed(live[int(i)]))
    return list(free)


def buffer_of(plan: BenchPlan, source: bool) -> npt.NDArray[np.uint8]:
    """The whole KV buffer of one side: the source filled from the plan's seed, the sink zeroed
    (and resident)."""
    size = plan.region_bytes * plan.regions
    if not source:
        buf = np.empty(size, dtype=np.uint8)
        buf.fill(0)  # resident: no first-touch faults inside the timed transfers
        return buf
    return np.random.default_rng(plan.seed).integers(0, 256, size, dtype=np.uint8)


def kv_buffer(plan: BenchPlan, source: bool) -> Any:
    """`buffer_of` in the plan's memory (a CUDA tensor for VRAM)."""
    return allocate(buffer_of(plan, source), plan.memory)


def _rows(plan: BenchPlan, base: int, device: int) -> npt.NDArray[np.int64]:
    """One descriptor per block per region, region-major: row = region * num_blocks + block."""
    r, b = np.divmod(np.arange(plan.regions * plan.num_blocks), plan.num_blocks)
    addr = base + plan.page_offset(r, b)
    return np.stack(
        [addr, np.full_like(addr, plan.block_bytes), np.full_like(addr, device)], axis=1
    )


def _ids(plan: BenchPlan, blocks: list[int]) -> npt.NDArray[np.int64]:
    b = np.asarray(blocks, dtype=np.int64)
    return (np.arange(plan.regions)[:, None] * plan.num_blocks + b[None, :]).ravel()


def check_sink(plan: BenchPlan, sink: npt.NDArray[np.uint8]) -> bool:
    """Every destination block of the sink holds its source block's bytes."""
    source, got = plan.pages(buffer_of(plan, True)), plan.pages(sink)
    return all(
        np.array_equal(got[:, d], source[:, s]) for s, d in zip(plan.src, plan.dst, strict=True)
    )


def serve_target(plan: BenchPlan, variant: Variant, conn: Connection) -> None:
    """The passive side of a raw run, in a process of its own: register the buffer, send
    (agent metadata, buffer address, device), drain notifications until the initiator says it
    is done, then send whether every byte arrived (True on the source side) and when each
    notification was drained (`time.monotonic`, by message)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvfsm.fabric import NixlFabric

    thread, telemetry, _ = _SETTINGS[variant]
    fabric = NixlFabric(
        "bench-target",
        progress_thread=thread,
        telemetry=telemetry,
        ucx_error_handling=plan.error_handling(variant),
        mem_type=plan.mem_type,
    )
    source = plan.op == "READ"  # the initiator READs from us, or WRITEs into us
    buf = kv_buffer(plan, source)
    handle = fabric.register_memory(buf)
    span = buffer_span(buf)
    conn.send((fabric.get_agent_metadata(), span.address, span.device))
    # Without NIXL's progress thread the target must progress UCX itself (TCP rendezvous needs
    # both ends), as an engine loop does by draining notifications between its waits.
    drained: dict[bytes, float] = {}

    def drain() -> None:
        for messages in fabric.get_new_notifs().values():
            now = time.monotonic()
            drained.update((m, now) for m in messages)

    while not conn.poll(_TARGET_POLL_S):
        drain()
    expected = conn.recv()  # the initiator is done: this many notifications are due
    deadline = time.monotonic() + _BOUND_S
    while len(drained) < expected and time.monotonic() < deadline:
        drain()  # a notification may trail its transfer's DONE at the initiator
    conn.send((True if source else check_sink(plan, on_host(buf)), drained))
    fabric.deregister_memory(handle)
    fabric.close()


class RawInitiator:
    """The initiator of a raw variant, ready to post: its agent with `variant`'s settings, its
    buffer registered, the target loaded, both descriptor lists prepared."""

    def __init__(self, plan: BenchPlan, variant: Variant, remote: tuple[bytes, int, int]) -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from kvfsm.fabric import NixlFabric

        thread, telemetry, self.merge = _SETTINGS[variant]
        self.plan, self.telemetry = plan, telemetry
        self.fabric = NixlFabric(
            "bench-initiator",
            progress_thread=thread,
            telemetry=telemetry,
            ucx_error_handling=plan.error_handling(variant),
            mem_type=plan.mem_type,
        )
        self.source = plan.op == "WRITE"
        self.buf = kv_buffer(plan, self.source)
        self.mem = self.fabric.register_memory(self.buf)
        self.peer = self.fabric.add_remote_agent(remote[0])
        span = buffer_span(self.buf)
        self.local = self.fabric.prep_xfer_dlist(None, _rows(plan, span.address, span.device))
        self.far = self.fabric.prep_xfer_dlist(self.peer, _rows(plan, remote[1], remote[2]))
        self._mine, self._theirs = (plan.src, plan.dst) if self.source else (plan.dst, plan.src)

    def xfer(self, i: int, notify: bytes = b"") -> XferHandle:
        """A transfer handle for request i's blocks (prepared rows), ready to post; the target
        is told `notify` when it is done (nothing if empty)."""
        plan = self.plan
        return self.fabric.make_prepped_xfer(
            plan.op,
            self.local,
            _ids(plan, self._mine[i]),
            self.far,
            _ids(plan, self._theirs[i]),
            notify,
            merge=self.merge,
        )

    def close(self) -> bool:
        """Whether every byte is in place here (True on the source side); then release all."""
        ok = True if self.source else check_sink(self.plan, on_host(self.buf))
        for dlist in (self.local, self.far):
            self.fabric.release_dlist_handle(dlist)
        self.fabric.remove_remote_agent(self.peer)
        self.fabric.deregister_memory(self.mem)
        self.fabric.close()
        return ok


def _initiator(plan: BenchPlan, variant: Variant, remote: tuple[bytes, int, int]) -> dict[str, Any]:
    me = RawInitiator(plan, variant, remote)
    # A warm-up transfer first (request 0's blocks, the same bytes): UCX wires its lanes up on
    # the first transfers (milliseconds), outside the timed run, as the engine's rows do.
    _post_all(me, 1, notify=False)
    latencies, moved, cpu0, t0, posted_at = _post_all(me, len(plan.src))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    ok = me.close()
    posted = len(plan.src) * len(plan.src[0]) * plan.regions
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "latency_s": latencies,
        "verified": ok,
        "descriptors": posted,
        "fabric_descriptors": moved if me.telemetry else None,
        "posted_at": posted_at,
    }


def _post_all(
    me: RawInitiator, n: int, notify: bool = True
) -> tuple[list[float], int, float, float, dict[bytes, float]]:
    """Post the first n requests, at most `plan.inflight` at once, each telling the target its
    number (if `notify`); each request's post-to-DONE time, the rows NIXL moved (after its
    merging, per its telemetry), and when each was posted (`time.monotonic`, by message)."""
    fabric, plan = me.fabric, me.plan
    pending: dict[int, float] = {}
    posted_at: dict[bytes, float] = {}
    latencies: list[float] = []
    moved = 0
    cpu0, t0, deadline = time.process_time(), time.monotonic(), time.monotonic() + _BOUND_S
    for i in range(n + plan.inflight):
        while pending and (len(pending) >= plan.inflight or i >= n):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} transfers still in flight after {_BOUND_S}s")
            for h, start in list(pending.items()):
                state = fabric.check_xfer_state(h)
                if state == "ERR":
                    raise RuntimeError("a transfer ended in ERR")
                if state == "DONE":
                    latencies.append(time.monotonic() - start)
                    telemetry = fabric.xfer_telemetry(h)
                    moved += telemetry.descriptors if telemetry else 0
                    fabric.release_xfer_handle(h)
                    del pending[h]
        if i < n:
            message = str(i).encode() if notify else b""
            h = me.xfer(i, message)
            pending[h] = time.monotonic()
            if notify:
                posted_at[message] = pending[h]
            fabric.transfer(h)
    return latencies, moved, cpu0, t0, posted_at


def _initiator_main(
    initiate: Callable[..., dict[str, Any]], args: tuple[Any, ...], conn: Connection
) -> None:
    try:
        remote = conn.recv()
        conn.send(("ok", initiate(*args, remote)))
    except Exception as exc:  # report, the driver fails the run saying why
        conn.send(("error", repr(exc)))


def run_variant(plan: BenchPlan, variant: Variant) -> dict[str, Any]:
    """One variant, target and initiator in processes of their own: the initiator's figures,
    `verified` true only if both ends found every byte in place, and `notified_s`: each
    request's time from its post to the target's draining of its notification."""
    return run_pair(plan, variant, _initiator, (plan, variant), variant)


def run_pair(
    plan: BenchPlan,
    target: Variant,
    initiate: Callable[..., dict[str, Any]],
    args: tuple[Any, ...],
    name: str,
) -> dict[str, Any]:
    """`serve_target` with `target`'s settings and `initiate(*args, remote)` in processes of
    their own (`remote`: the target's agent metadata, buffer address and device)."""
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    procs = [
        ctx.Process(
            target=serve_target,
            args=(plan, target, t_child),
            daemon=True,
            name=f"{name} target",
        ),
        ctx.Process(
            target=_initiator_main,
            args=(initiate, args, i_child),
            daemon=True,
            name=f"{name} initiator",
        ),
    ]
    for p in procs:
        p.start()
    try:
        i_conn.send(recv_bounded(t_conn, "target", procs[:1]))
        status, result = recv_bounded(i_conn, "initiator", procs)
        if status != "ok":
            raise RuntimeError(f"bench initiator ({name}): {result}")
        posted_at: dict[bytes, float] = result.pop("posted_at", {})
        t_conn.send(len(posted_at))
        ok, drained = recv_bounded(t_conn, "target", procs[:1])
        result["verified"] = bool(result["verified"] and ok)
        # The clock is the host's monotonic one, the same in both processes.
        result["notified_s"] = [drained[m] - t for m, t in posted_at.items() if m in drained]
        if len(result["notified_s"]) < len(posted_at):
            raise RuntimeError(f"bench target ({name}): notifications missing")
        return dict(result)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def recv_bounded(conn: Connection, who: str, procs: Sequence[BaseProcess]) -> Any:
    """The next message from the bench process `who`; RuntimeError as soon as one of `procs`
    (the processes the message depends on) has exited without it being sent, TimeoutError
    after the bound."""
    deadline = time.monotonic() + _BOUND_S
    while not conn.poll():
        ready = wait([conn, *(p.sentinel for p in procs)], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"the bench {who} did not answer in {_BOUND_S}s")
        dead = [p for p in procs if p.sentinel in ready]
        for p in dead:
            p.join(_REAP_S)  # it has exited: this only reaps it, for its exit code
        if dead and not conn.poll():
            exits = ", ".join(f"{p.name} exited with code {p.exitcode}" for p in dead)
            raise RuntimeError(f"the bench {who} did not answer: {exits} (see its error output)")
    return conn.recv()


def memcpy_gbps(plan: BenchPlan, repeat: int = 3) -> float:
    """GB/s of copying the same blocks between two buffers in the plan's memory (numpy's
    gather/scatter on the host, torch's on a CUDA device)."""
    shape = (plan.regions, plan.num_blocks, plan.block_bytes)
    moves = list(zip(plan.src, plan.dst, strict=True))
    return copy_gbps(kv_buffer(plan, True), kv_buffer(plan, False), shape, moves, repeat)


def gbps(plan: BenchPlan, result: dict[str, Any]) -> float:
    """Throughput of one variant's run."""
    return plan.bytes_per_request * len(plan.src) / float(result["wall_s"]) / 1e9
