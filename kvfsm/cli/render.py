"""Terminal output: progress bars and summary tables (rich)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from kvfsm.cli.demo._report import DemoReport
    from kvfsm.cli.scenario._run import ScenarioReport

__all__ = ["bench_table", "demo_table", "figures_table", "progress_bar", "scenario_table"]


@contextmanager
def progress_bar(
    total: int, enabled: bool = True, label: str = "requests"
) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr; yields `advance(n)`. Disabled, it yields a no-op."""
    if not enabled:
        yield lambda _n: None
        return
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)


def demo_table(report: DemoReport) -> None:
    """Print a demo's summary: outcomes, bytes, speed, verification and time in each state."""
    console = Console()
    summary = Table(title=f"kvfsm demo: {report.mode} on {report.fabric}")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    blocks = f"{report.p_block_size} -> {report.d_block_size} tokens"
    rows: list[tuple[str, object]] = [
        ("requests", report.requests),
        (
            "done / failed / expired / aborted",
            f"{report.done} / {report.failed} / {report.expired} / {report.aborted}",
        ),
        ("every byte verified", "yes" if report.verified else "NO"),
        ("safety violations", len(report.violations)),
        ("TP (P -> D)", f"{report.p_tp} -> {report.d_tp}"),
        ("block size (P -> D)", blocks),
        ("bytes moved", f"{report.bytes:,}"),
    ]
    if report.fabric == "nixl":
        rows += [
            ("model", report.model),
            ("GB/s (demo wall time)", f"{report.gbps:.2f}"),
            (
                "hand-off p50 / p99 (ms)",
                f"{report.handoff_ms_p50:.2f} / {report.handoff_ms_p99:.2f}",
            ),
            (
                "descriptors posted / moved by NIXL",
                f"{report.descriptors:,} / {report.fabric_descriptors:,}",
            ),
            ("wall seconds", f"{report.wall_s:.2f}"),
        ]
    else:
        rows += [("simulated seconds", f"{report.simulated_s:.3f}")]
    rows.append(("CPU seconds (this process)", f"{report.cpu_s:.2f}"))
    for name, value in rows:
        summary.add_row(name, str(value))
    console.print(summary)
    clock = "simulated" if report.fabric == "sim" else "wall-clock"
    states = Table(title=f"mean time in state ({clock} ms)")
    states.add_column("side")
    states.add_column("state")
    states.add_column("ms", justify="right")
    for side, by_state in report.time_in_state_ms.items():
        for state, ms in by_state.items():
            states.add_row(side, state, f"{ms:.3f}")
    console.print(states)
    for violation in report.violations[:20]:
        console.print(f"[red]violation:[/red] {violation}")


def bench_table(report: dict[str, object]) -> None:
    """Print `kvfsm bench`'s figures: one row per variant, ratios to the vLLM-style anchor."""
    console = Console()
    title = (
        f"kvfsm bench: {report['op']} ({report['mode']}) in {report['memory']},"
        f" {report['allocation']} blocks,"
        f" {report['descriptors_per_request']} descriptors of {report['block_bytes']} B per request"
        f"; each variant's median of {report['repeat']} runs"
    )
    table = Table(title=title)
    columns = (
        "variant",
        "GB/s",
        "p50 ms",
        "p99 ms",
        "CPU us/request",
        "rows posted/moved",
        "vs a1",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "variant" else "right")
    anchor = report.get("raw_vllm_style_gbps")
    rows = [
        ("a1 raw, vLLM's way", "raw_vllm_style"),
        ("a2 raw, kvfsm's settings", "raw"),
        ("a2 raw, unmerged", "raw_unmerged"),
        ("b  engine per block", "engine"),
        ("c  engine coalesced", "coalesced"),
        ("v  engine, verify=all", "verified"),
        ("d  memcpy" if report["memory"] == "dram" else "d  device copy", "memcpy"),
    ]
    for label, key in rows:
        if f"{key}_gbps" not in report:  # a variant left out (--variants)
            continue
        value = float(report[f"{key}_gbps"])  # type: ignore[arg-type]
        cells = [
            f"{report[f'{key}_{x}']:.2f}" if f"{key}_{x}" in report else ""
            for x in ("ms_p50", "ms_p99", "cpu_us_per_request")
        ]
        posted, moved = (report.get(f"{key}_{x}descriptors_per_request") for x in ("", "fabric_"))
        rows_cell = (
            "" if posted is None else f"{posted:.0f}/{'?' if moved is None else f'{moved:.0f}'}"
        )
        vs_a1 = "" if anchor is None else f"{value / float(anchor):.2f}"  # type: ignore[arg-type]
        table.add_row(label, f"{value:.2f}", *cells, rows_cell, vs_a1)
    console.print(table)
    by_round: list[float] = report["ratio_engine_raw_by_round"]  # type: ignore[assignment]
    rounds = ", ".join(f"{r:.2f}" for r in by_round)
    c_a1, v_b = report.get("ratio_coalesced_raw"), report.get("ratio_verified_engine")
    console.print(
        f"b/a2 {report['ratio_engine_raw']:.2f} (round by round: {rounds})"
        + ("" if c_a1 is None else f"; c/a1 {c_a1:.2f}")
        + ("" if v_b is None else f"; v/b {v_b:.2f} (the cost of verify=all)")
    )
    raw_us = float(report["raw_time_us_per_request"])  # type: ignore[arg-type]
    console.print(
        f"engine {report['engine_extra_us_per_request']:+.0f} µs a request over raw NIXL's"
        f" {raw_us:.0f} (b/a2 >= 0.95 allows {raw_us / 19:.0f})"
    )
    hops: dict[str, float | None] = report["handoff_hops_us"]  # type: ignore[assignment]
    steps = " + ".join(f"{name} {'?' if us is None else f'{us:.0f}'}" for name, us in hops.items())
    console.print(
        f"hand-off p50 {report['handoff_us_p50']:.0f} µs (p99 {report['handoff_us_p99']:.0f})"
        f" against raw NIXL's post to notification drained {report['raw_notified_us_p50']:.0f}"
        f" (p99 {report['raw_notified_us_p99']:.0f}); hops' medians in µs: {steps}"
    )
    idle: dict[str, float] = report["engine_idle_cpu_per_s"]  # type: ignore[assignment]
    console.print(f"engine idle: P {idle['P']:.1%} of a core, D {idle['D']:.1%}")
    sweep = report.get("by_inflight")
    if isinstance(sweep, dict):
        by = Table(title="by transfers in flight")
        for column in (
            "in flight",
            "a2 GB/s",
            "b GB/s",
            "b/a2",
            "hand-off p50 µs",
            "raw notified p50 µs",
        ):
            by.add_column(column, justify="right")
        for n, f in sweep.items():
            by.add_row(
                n,
                f"{f['raw_gbps']:.2f}",
                f"{f['engine_gbps']:.2f}",
                f"{f['ratio_engine_raw']:.2f}",
                f"{f['handoff_us_p50']:.0f}",
                f"{f['raw_notified_us_p50']:.0f}",
            )
        console.print(by)
    control = report.get("control_us_per_request")
    engine = report.get("control_engine_us_per_request")
    if isinstance(control, dict) and isinstance(engine, dict):
        plane = Table(title="control plane: CPU µs per request lifecycle (P and D, no data)")
        for column in ("in flight", "core", "engines on SimFabric"):
            plane.add_column(column, justify="right")
        for n, us in control.items():
            plane.add_row(n, f"{us:.1f}", f"{engine[n]:.1f}")
        console.print(plane)
    console.print("every byte verified" if report["verified"] else "[red]BYTES WRONG[/red]")


def figures_table(title: str, figures: Mapping[str, Any], as_json: bool = False) -> None:
    """Print a benchmark's figures: one JSON object, or a table of figure and value."""
    if as_json:
        print(json.dumps(dict(figures)))
        return
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)


def scenario_table(report: ScenarioReport) -> None:
    """Print one scenario run: every request's trace and final states, then the verdict."""
    console = Console()
    console.print(f"[bold]{report.name}[/bold] ({report.mode}, {report.fabric} fabric)")
    if report.reference:
        console.print(f"reproduces: {report.reference}")
    for key, outcome in report.requests.items():
        finals = ", ".join(f"{agent} {state}" for agent, state in outcome.final_state.items())
        trace = Table(title=f"{key}: {finals}", title_justify="left")
        for column in ("t (s)", "rank", "event", "state entered"):
            trace.add_column(column, justify="right" if column == "t (s)" else "left")
        for entry in outcome.trace:
            trace.add_row(f"{entry.t:.4f}", entry.agent, entry.event, entry.state)
        console.print(trace)
    for agent, counted in report.counters.items():
        console.print(f"{agent} counted: " + ", ".join(f"{k} {n}" for k, n in counted.items()))
    for problem in report.violations:
        console.print(f"[red]violation:[/red] {problem}")
    for problem in report.unmet:
        console.print(f"[red]unmet:[/red] {problem}")
    verdict = "[green]passed[/green]" if report.passed else "[red]FAILED[/red]"
    console.print(f"{verdict} after {report.elapsed_s:.3f} s of {report.fabric} time")
