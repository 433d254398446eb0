"""Scenario files: a P/D deployment, its requests, a timeline and faults, declared in TOML.

A scenario is untrusted input like any other file a user hands us: it is decoded with msgspec
types (unknown keys refused), bounded in size, and cross-checked (requests and agents named in the
timeline exist, faults exist on the fabrics the scenario claims), so a mistake gives
`ScenarioError` naming the file and the place, never a traceback from deep inside a run.
The format is documented in docs/scenarios.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.toml

from kvfsm.core import CoreConfig
from kvfsm.fabric import SimFaults
from kvfsm.lifecycle import load
from kvfsm.sim import FAST_CONFIG

__all__ = [
    "MAX_SCENARIO_BYTES",
    "SIM_ONLY_FAULTS",
    "AbortStep",
    "AdmitStep",
    "AdvanceStep",
    "EngineSpec",
    "ExpectStep",
    "FaultStep",
    "FinishStep",
    "Outcome",
    "RequestSpec",
    "Scenario",
    "ScenarioError",
    "Step",
    "UntilStep",
    "core_config",
    "load_scenario",
    "scenario_of",
]

MAX_SCENARIO_BYTES = 1 << 20
"""Largest scenario file read (a timeline of tens of thousands of steps)."""

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
_Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)]
_States = str | list[str]
Side = Literal["P", "D"]
Fabric = Literal["sim", "nixl"]
FaultKind = Literal[
    "drop",
    "duplicate",
    "delay",
    "hold",
    "release",
    "reorder",  # notifications to `agent`
    "fail_post",
    "err",
    "stuck",
    "lag",  # `agent`'s next transfer
    "kill",
    "cut",
    "revive",  # `agent`'s process: dies (reset), goes silent, is replaced
    "handshake_fail",
    "handshake_hang",  # the next handshake with `agent`
    "garbage",  # a malformed notification reaches `agent`
    "lose",  # the next notification of kind `message` reaching `agent` is lost
    "outage",  # every notification reaching `agent` is lost for `seconds`
    "side_channel_cut",
    "side_channel_restore",  # `agent`'s side channel: handshakes fail, questions unanswered
]
SIM_ONLY_FAULTS = frozenset(
    {
        "drop",
        "duplicate",
        "delay",
        "hold",
        "release",
        "reorder",
        "fail_post",
        "err",
        "stuck",
        "lag",
        "kill",
        "cut",
        "revive",
    }
)
"""Faults only the simulated fabric can inject (real NIXL cannot be told to lose a message)."""


class ScenarioError(ValueError):
    """A scenario file cannot be run as written; the message names the file and the place."""


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One serving engine (all its TP ranks): its side, mode, TP size and KV geometry."""

    side: Side
    mode: Literal["push", "pull"]
    tp: Annotated[int, msgspec.Meta(ge=1, le=4)] = 1
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4
    """Tokens per block; D's must be a multiple of P's."""
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 24
    mla: bool = False
    """Replicated latent KV (one copy on every rank) instead of heads split by TP."""
    clock_skew: Annotated[float, msgspec.Meta(ge=-1e9, le=1e9)] = 0.0
    """Seconds added to this engine's clock: a host whose monotonic clock started elsewhere."""


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A request: how many P blocks its prompt fills and how many of them D already holds."""

    id: _Name
    blocks: Annotated[int, msgspec.Meta(ge=0, le=64)] = 2
    cached: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    """D's prefix-cache hit, in P blocks; D holds the whole D blocks they fill (at most
    `blocks`)."""
    same_id: bool = False
    """P and D know the request by the same id (else D learns P's id from the params)."""


class _Step(msgspec.Struct, frozen=True, kw_only=True, tag_field="do", forbid_unknown_fields=True):
    pass


class AdmitStep(_Step, frozen=True, tag="admit"):
    """Both engines admit the request (P first, or D first)."""

    request: _Name
    d_first: bool = False


class FinishStep(_Step, frozen=True, tag="finish"):
    """P's prefill of the request finishes (with `without_blocks`, P has no KV for it)."""

    request: _Name
    without_blocks: bool = False


class AbortStep(_Step, frozen=True, tag="abort"):
    """The serving engine of `side` aborts the request."""

    request: _Name
    side: Side


class AdvanceStep(_Step, frozen=True, tag="advance"):
    """The clock moves `seconds` (simulated; real time on the real fabric); engines poll."""

    seconds: _Seconds


class UntilStep(_Step, frozen=True, tag="until"):
    """Time passes in 1 ms steps until the request is in one of `state` on `agent`."""

    request: _Name
    agent: str
    state: _States
    within: _Seconds = 10.0


class ExpectStep(_Step, frozen=True, tag="expect"):
    """Right now, the request is in one of `state` on `agent` ("gone" once it ended)."""

    request: _Name
    agent: str
    state: _States


class FaultStep(_Step, frozen=True, tag="fault"):
    """Inject one fault aimed at `agent` (see `FaultKind`); `seconds` for delay, hang and
    outage."""

    kind: FaultKind
    agent: str
    seconds: _Seconds = 0.7
    payload: Annotated[str, msgspec.Meta(max_length=256)] = "kv1"
    message: Literal["reg", "grant", "writing", "done", "fail", "cancel", "ack", "hb"] = "done"
    """For `lose`: the wire tag of the notification to lose (done, reg, grant, writing, fail,
    cancel, ack, hb)."""


Step = AdmitStep | FinishStep | AbortStep | AdvanceStep | UntilStep | ExpectStep | FaultStep


class Outcome(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """After the run settled, the request ended in one of `state` on `agent` (or every rank of
    `side`)."""

    request: _Name
    state: _States
    agent: str | None = None
    side: Side | None = None


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A whole scenario file."""

    description: str
    engines: list[EngineSpec]
    requests: list[RequestSpec]
    timeline: list[Step]
    name: str = ""
    """Defaults to the file's stem."""
    reference: str = ""
    """Which failure of the systems kvfsm replaces this scenario reproduces."""
    fabrics: list[Fabric] = msgspec.field(default_factory=lambda: ["sim"])
    """Where the scenario is meant to run and pass."""
    seed: int = 0
    config: dict[str, float | int] = msgspec.field(default_factory=dict)
    """`CoreConfig` bounds overriding the simulated cluster's short defaults."""
    network: dict[str, float] = msgspec.field(default_factory=dict)
    """`SimFaults`: latencies and background fault probabilities (simulated fabric only)."""
    expect: list[Outcome] = msgspec.field(default_factory=list)

    @property
    def mode(self) -> Literal["push", "pull"]:
        """The transfer mode (both engines run the same one)."""
        return self.engines[0].mode

    def engine(self, side: Side) -> EngineSpec:
        """The engine of one side."""
        return next(e for e in self.engines if e.side == side)

    def agents(self) -> list[str]:
        """Every rank's agent name, P's first."""
        return [f"{s}#{r}" for s in ("P", "D") for r in range(self.engine(s).tp)]

    def uses_sim_only_faults(self) -> bool:
        """Whether a step injects a fault the real fabric cannot, or the network has any setting."""
        steps = (s for s in self.timeline if isinstance(s, FaultStep))
        return bool(self.network) or any(s.kind in SIM_ONLY_FAULTS for s in steps)


def load_scenario(path: str | Path) -> Scenario:
    """Read, decode and cross-check one scenario file; `ScenarioError` says what is wrong."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SCENARIO_BYTES + 1)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"{path}: larger than {MAX_SCENARIO_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:  # msgspec would raise it raw: say where instead
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ScenarioError(
            f"{path}: not UTF-8 text: {exc.reason} (at line {line}, byte {column})"
        ) from None
    try:
        scenario = msgspec.toml.decode(text, type=Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ScenarioError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None
    return _checked(scenario, path.stem, str(path))


def scenario_of(data: Mapping[str, Any], name: str) -> Scenario:
    """A scenario written in code: `data` as a scenario file's TOML would decode, checked the
    same way (`ScenarioError` says what is wrong)."""
    try:
        scenario = msgspec.convert(data, Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{name}: {exc}") from None
    return _checked(scenario, name, name)


def _checked(scenario: Scenario, name: str, where: str) -> Scenario:
    if not scenario.name:
        scenario = msgspec.structs.replace(scenario, name=name)
    problems = _problems(scenario)
    if problems:
        raise ScenarioError(f"{where}: " + "; ".join(problems))
    return scenario


def _problems(s: Scenario) -> list[str]:
    sides = sorted(e.side for e in s.engines)
    if sides != ["D", "P"]:
        return [f"engines: need exactly one P and one D engine, got {sides}"]
    problems = []
    if len({e.mode for e in s.engines}) > 1:
        problems.append("engines: P and D must run the same mode")
    p, d = s.engine("P"), s.engine("D")
    if d.block_size % p.block_size:
        problems.append(f"engines: D's block_size {d.block_size} is not a multiple of P's")
    if (p.num_blocks, p.mla) != (d.num_blocks, d.mla):
        problems.append("engines: P and D need the same num_blocks and mla")
    ids = [r.id for r in s.requests]
    problems += [f"requests: {i!r} declared twice" for i in sorted(set(ids)) if ids.count(i) > 1]
    problems += _reference_problems(s, set(ids))
    problems += _state_problems(s)
    problems += _config_problems(s)
    if "nixl" in s.fabrics and s.uses_sim_only_faults():
        problems.append("fabrics: lists nixl, but the scenario uses faults of the simulated fabric")
    return problems


def _reference_problems(s: Scenario, ids: set[str]) -> list[str]:
    agents = set(s.agents())
    problems = []
    places: list[tuple[str, Step | Outcome]] = [
        (f"timeline[{i}]", step) for i, step in enumerate(s.timeline)
    ]
    places += [(f"expect[{i}]", outcome) for i, outcome in enumerate(s.expect)]
    for where, item in places:
        request = getattr(item, "request", None)
        if request is not None and request not in ids:
            problems.append(f"{where}: no request {request!r} in requests")
        agent = getattr(item, "agent", None)
        if agent is not None and agent not in agents:
            problems.append(f"{where}: no agent {agent!r} (agents: {', '.join(sorted(agents))})")
    for i, outcome in enumerate(s.expect):
        if (outcome.agent is None) == (outcome.side is None):
            problems.append(f"expect[{i}]: name exactly one of agent and side")
    return problems


def _state_problems(s: Scenario) -> list[str]:
    """Expectations naming a state no request lifecycle has (a typo would otherwise run and
    fail as if a property were broken)."""
    known = _request_states()
    places: list[tuple[str, ExpectStep | Outcome]] = [
        (f"timeline[{i}]", step)
        for i, step in enumerate(s.timeline)
        if isinstance(step, ExpectStep)
    ]
    places += [(f"expect[{i}]", outcome) for i, outcome in enumerate(s.expect)]
    problems = []
    for where, item in places:
        states = [item.state] if isinstance(item.state, str) else item.state
        problems += [
            f"{where}: no state {state!r} (states: {', '.join(sorted(known))})"
            for state in states
            if state not in known
        ]
    return problems


def _request_states() -> set[str]:
    """Every state of the request lifecycles, and what a run reports beside them: "dead" (the
    rank's process died with it), "absent" (it never reached the rank), "gone"."""
    names = ("producer_push", "consumer_push", "producer_pull", "consumer_pull")
    found = {state.name for name in names for state in load(name).model.states}
    return found | {"dead", "absent", "gone"}


def core_config(s: Scenario) -> CoreConfig:
    """The simulated cluster's short bounds with the scenario's overrides, validated together."""
    merged = {**msgspec.structs.asdict(FAST_CONFIG), **s.config}
    return msgspec.convert(merged, CoreConfig)


def _config_problems(s: Scenario) -> list[str]:
    known = {f.name for f in dataclasses.fields(SimFaults)}
    unknown = sorted(set(s.network) - known)
    if unknown:
        return [f"network: unknown settings {unknown} (known: {', '.join(sorted(known))})"]
    try:
        SimFaults(**s.network)
        core_config(s)
    except (ValueError, TypeError, msgspec.ValidationError) as exc:
        return [f"config/network: {exc}"]
    return []
