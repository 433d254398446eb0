"""Driving a request to any live state of its lifecycle on a simulated cluster, for the tests and
the tour that must start something (an abort, a bug) from every state."""

from __future__ import annotations

from kvfsm.core import CommandFailed
from kvfsm.lifecycle import load
from kvfsm.sim import Cluster, PairedRequest

__all__ = ["abandon_in", "drive_to", "live_states"]


def live_states(mode: str, side: str) -> list[str]:
    """The non-terminal states of `side`'s request lifecycle in `mode`, in model order."""
    model = load(f"{'producer' if side == 'P' else 'consumer'}_{mode}")
    return [s for s in model.states if s not in model.terminal]


def _run(cluster: Cluster, seconds: float, dt: float = 0.01) -> None:
    for _ in range(round(seconds / dt)):
        cluster.step(dt)


def drive_to(cluster: Cluster, side: str, target: str) -> PairedRequest:
    """Admit a new request "r" and drive it to the state `target` on `side`'s rank 0 (TP 1 to
    1): handshakes hang, notifications drop or transfers stick where that state waits."""
    net, mode = cluster.network, cluster.mode
    if target == "releasing":  # a full prefix-cache hit, D's handshake with P hanging
        cluster.directory.hang_next("P#0")
        return cluster.admit("r", 4, d_cached=4)
    if side == "D" and target == "allocated":  # D's handshake with P hangs
        cluster.directory.hang_next("P#0")
        return cluster.admit("r", 4)
    if side == "P" and target == "matched":  # P's handshake with D hangs
        cluster.directory.hang_next("D#0")
    if (side == "P" and target in ("allocated", "leased")) or target == "fencing":
        net.drop_next_notif("P#0")  # D's registration
    if target == "fencing":  # and P's connection to D, to acknowledge D's cancel, hangs
        cluster.directory.hang_next("D#0")
    pr = cluster.admit("r", 4)
    _run(cluster, 0.05)
    if target == "fencing":  # D's watchdog fires
        _run(cluster, cluster.config.watchdog_s)
    if target in ("allocated", "registered", "fencing"):
        return pr
    if target in ("writing", "reading", "draining"):  # the transfer hangs
        net.inject_next_post("P#0" if mode == "push" else "D#0", "stuck")
    cluster.finish_prefill("r")
    _run(cluster, 0.05)
    if target == "draining":  # push: D gives up on P's WRITE; pull: P gives up while D reads
        cluster.abort("r", "D" if mode == "push" else "P")
        _run(cluster, 0.05)
    return pr


def abandon_in(mode: str, side: str, target: str) -> Cluster:
    """A request driven to `target` on `side`, then hit by a bug the runtime reports
    (`CommandFailed`): the core must give it up safely from there."""
    cluster = Cluster(mode)  # type: ignore[arg-type]
    pr = drive_to(cluster, side, target)
    agent = f"{side}#0"
    rid = pr.p_id if side == "P" else pr.d_id
    engine = cluster.engines[agent]
    state = engine.side.requests[rid].state
    if state != target:
        raise AssertionError(f"{agent} {rid} is {state}, not {target}")
    engine.submit(CommandFailed(rid, f"planted in {target}"))
    cluster.collect()
    return cluster
