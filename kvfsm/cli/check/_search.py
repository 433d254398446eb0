"""The search of `kvfsm check`: breadth first over action sequences, in this process or spread
over worker processes.

Each explored transition is a path replayed on a fresh cluster (`_explore`), which needs nothing
but the path: so the paths of one depth level can be replayed anywhere. The search here keeps
the books in one place and takes the results in the order of the frontier, whoever replayed
them, so that a run with workers finds exactly the states, transitions, paths and shortest
traces a run without them finds.

A worker skips the end-of-run checks and the list of enabled actions of a state it reported
before: it reported that state for an earlier task, whose result the search took first, so the
search already knows it and drops this one. States two workers both meet are checked by both;
the search keeps the first.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from kvfsm.cli.check._replay import (
    _BLOCKS,
    _END,
    MAX_DEPTH,
    Action,
    CheckReport,
    CheckViolation,
    Path,
    _conformance,
    _end_of_run,
    _Run,
)
from kvfsm.cli.check._state import Namer, fingerprint
from kvfsm.core import Mode
from kvfsm.lifecycle import MODEL_NAMES, load

__all__ = ["default_workers", "run_check"]

_PARENTS_PER_TASK = 4  # parents a worker expands per task: fewer messages, same order

Level = list[tuple[Path, tuple[Action, ...]]]  # a depth level: paths and the actions to try


class _Found(NamedTuple):
    """What replaying one path found."""

    problems: list[str]  # named, in the order found; with no `key`, the replay broke them
    key: bytes | None = None  # the state's fingerprint; None: known already, or broken
    enabled: tuple[Action, ...] = ()  # to expand: the path may go on (else it ended here)
    cut: bool = False  # it ended at the depth bound with actions still enabled
    at_end: bool = False  # `problems` are the end-of-run checks'


class _Explorer:
    """Replays paths of one bound; `known` says which states need no further work."""

    def __init__(self, mode: Mode, report: CheckReport, known: Callable[[bytes], bool]):
        self.mode: Mode = mode
        self.bound = (report.max_faults, report.requests, report.depth_bound)
        self.known = known
        self.answers: dict[Any, Any] = {}
        self.taken: set[Any] = set()

    def _replay(self, path: Path, labelled: bool = False) -> _Run:
        run = _Run(self.mode, self.answers, self.taken)
        run.labelled = labelled
        for action in path:
            run.apply(action)
        return run

    def explore(self, path: Path) -> _Found:
        """Replay `path` and check it; the path's end gets the end-of-run checks."""
        run = self._replay(path)
        c = run.cluster
        if problems := c.ledger.violations + _conformance(c):
            return _Found(_named(c, problems))
        fp = fingerprint(c, run.faults, frozenset(run.spent))
        if self.known(fp):
            return _Found([])
        max_faults, requests, depth_bound = self.bound
        enabled = run.enabled(max_faults, requests)
        if enabled and len(path) < depth_bound:
            return _Found([], fp, tuple(enabled))
        problems = _end_of_run(c)
        return _Found(_named(c, problems), fp, (), bool(enabled), True)

    def trace(self, path: Path, at_end: bool) -> list[str]:
        """The readable trace of `path` (replayed once more, with labels)."""
        return self._replay(path, labelled=True).labels + [_END] * at_end


def _named(c: Any, problems: list[str]) -> list[str]:
    return [Namer(c).id(p) for p in dict.fromkeys(problems)]


def _child_paths(level: Level) -> Iterator[Path]:
    """Every child of `level`'s paths, in order."""
    return ((*path, action) for path, actions in level for action in actions)


def _children(explorer: _Explorer, level: Level) -> Iterator[_Found]:
    """Replay every child of `level`'s paths, in order."""
    return (explorer.explore(path) for path in _child_paths(level))


class _Search:
    """The breadth-first search's books."""

    def __init__(self, mode: Mode, report: CheckReport) -> None:
        self.report = report
        self.seen: set[bytes] = set()
        self.explorer = _Explorer(mode, report, self.seen.__contains__)
        self.found: dict[str, CheckViolation] = {}
        self.actions: dict[Action, Action] = {}  # one object per distinct action: paths share them

    def take(self, path: Path, found: _Found) -> tuple[Action, ...]:
        """Book what replaying `path` found; returns the actions to try from it (none: do not
        expand it: it ended, broke a property, or its state was reached before)."""
        report = self.report
        if found.key is not None:
            if found.key in self.seen:
                return ()  # another worker met it first
            self.seen.add(found.key)
            if found.enabled:
                return tuple(self.actions.setdefault(a, a) for a in found.enabled)
            report.paths += 1
            report.paths_cut += found.cut
        if found.problems:
            report.violating_transitions += 1
            if found.problems[0] not in self.found:
                trace = self.explorer.trace(path, found.at_end)
                self.found[found.problems[0]] = CheckViolation(trace, found.problems)
        return ()


# A worker process's explorer, set up once by `_start_worker`.
_worker: _Explorer | None = None
_reported: set[bytes] = set()
_taken_sent: set[Any] = set()


def _start_worker(mode: Mode, report: CheckReport) -> None:
    global _worker
    _worker = _Explorer(mode, report, _reported.__contains__)


def _expand(parents: Level) -> tuple[list[_Found], set[Any]]:
    """In a worker: replay every child of `parents`, in order; also the model transitions taken
    that this worker has not reported yet."""
    assert _worker is not None
    out = []
    for found in _children(_worker, parents):  # lazily: a sibling's state is known at once
        if found.key is not None:
            _reported.add(found.key)
        out.append(found)
    fresh = _worker.taken - _taken_sent
    _taken_sent.update(fresh)
    return out, fresh


def default_workers() -> int:
    """Worker processes `kvfsm check` uses unless told: one per CPU this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_check(
    mode: Mode,
    *,
    max_faults: int = 2,
    requests: int = 2,
    max_depth: int = MAX_DEPTH,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
) -> CheckReport:
    """Explore every interleaving of `requests` requests (1 or 2) on 1 P and 1 D in `mode`, with
    up to `max_faults` faults and `max_depth` actions per path, breadth first, replaying paths
    in `workers` processes (1: in this one; the report is the same); `progress(n)` reports
    depth levels done (`max_depth` in all)."""
    if not 1 <= requests <= len(_BLOCKS) or max_faults < 0 or max_depth < 1 or workers < 1:
        raise ValueError(
            f"requests must be 1 to {len(_BLOCKS)}, faults >= 0, depth >= 1 and workers >= 1"
        )
    start = time.perf_counter()
    report = CheckReport(mode, max_faults, requests, max_depth)
    search = _Search(mode, report)
    level: Level = []
    if actions := search.take((), search.explorer.explore(())):
        level.append(((), actions))
    replayers = _Replayers(mode, report, workers, search.explorer)
    with replayers as replay:
        depth = 0
        while level:
            depth += 1
            nxt = []
            for path, found in zip(_child_paths(level), replay(level), strict=True):
                report.transitions += 1
                if actions := search.take(path, found):
                    nxt.append((path, actions))
            report.max_depth = depth
            if progress is not None:
                progress(1)
            level = nxt
    if progress is not None and depth < max_depth:
        progress(max_depth - depth)
    report.states_explored = len(search.seen)
    report.model_transitions_taken = len(search.explorer.taken | replayers.taken)
    models = [m for m in MODEL_NAMES if not m.endswith(("_push", "_pull")) or m.endswith(mode)]
    report.model_transitions = sum(len(load(name).edges) for name in models)
    report.violations = list(search.found.values())
    report.elapsed_s = round(time.perf_counter() - start, 3)
    return report


class _Replayers:
    """Replays a level's children in order: here, or in a pool of worker processes."""

    def __init__(self, mode: Mode, report: CheckReport, workers: int, here: _Explorer) -> None:
        self.here, self.taken = here, set[Any]()
        self.pool = None
        if workers > 1:
            # fork where there is one: workers start at once and run the code as loaded here
            # (a test's patched method included); elsewhere they import it afresh.
            # Python 3.12 warns of forking beside other threads (a test process has some): the
            # workers run only the simulation, which takes no lock those threads may hold.
            # The collector is frozen across the fork: a worker's collections then never
            # finalise what it inherited, such as a NIXL agent left for garbage by a test run
            # in this process, whose UCX endpoints share an epoll set with this process.
            methods = mp.get_all_start_methods()
            ctx = mp.get_context("fork" if "fork" in methods else None)
            gc.collect()
            gc.freeze()
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings(
                        "ignore", "This process .* is multi-threaded", DeprecationWarning
                    )
                    self.pool = ctx.Pool(workers, _start_worker, (mode, report))
            finally:
                gc.unfreeze()

    def __enter__(self) -> Callable[[Level], Iterator[_Found]]:
        return self.replay

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def replay(self, level: Level) -> Iterator[_Found]:
        if self.pool is None:
            yield from _children(self.here, level)
            return
        tasks = [level[i : i + _PARENTS_PER_TASK] for i in range(0, len(level), _PARENTS_PER_TASK)]
        for found, taken in self.pool.imap(_expand, tasks):
            self.taken |= taken
            yield from found
