"""Conformance at run time: every step the core takes, replayed through the `transitions`
machine built from the same model, so a core that drifted from `models/` is seen in production,
not only in the test suite (safety property 6, docs/testing.md)."""

from __future__ import annotations

from collections.abc import Callable

from kvfsm.core import Step
from kvfsm.lifecycle import load

__all__ = ["Conformance"]

_KEPT = 16

_Key = tuple[str, str, str, frozenset[tuple[str, bool]]]


class Conformance:
    """Replays each recorded `Step` through `transitions` and compares dest and commands.

    The machine's answer depends only on (lifecycle, state, event, guard values), so each
    distinct input is replayed once and remembered: a step costs a dict lookup after the first
    of its kind. `on_divergence` receives each divergence's description (a bug: the core took
    a step its model does not have); `divergences` counts them, `violations` keeps the last
    `keep` (all with None).
    """

    def __init__(
        self, on_divergence: Callable[[str], None] | None = None, keep: int | None = _KEPT
    ) -> None:
        self.steps = 0
        self.divergences = 0
        self.violations: list[str] = []
        self._keep = keep
        self.on_divergence = on_divergence
        self._answers: dict[_Key, tuple[str, list[str]]] = {}

    def share_answers(self, answers: dict[_Key, tuple[str, list[str]]]) -> None:
        """Cache what the `transitions` machines answer in `answers`, shared with other checkers:
        the answers depend on the models only, so a search's many runs ask each question once."""
        self._answers = answers

    def record(self, step: Step) -> None:
        """Check one step (installed with `Side.set_recorder`)."""
        self.steps += 1
        key = (step.lifecycle, step.source, step.event, frozenset(step.guards.items()))
        answer = self._answers.get(key)
        if answer is None:
            try:
                answer = load(step.lifecycle).replay(step.source, step.event, step.guards)
            except Exception as exc:
                answer = (f"<machine refused: {exc}>", [])
            self._answers[key] = answer
        if answer != (step.dest, list(step.commands)):
            message = (
                f"conformance: {step.lifecycle} {step.instance}: {step.source} --{step.event}--> "
                f"core took {step.dest} {list(step.commands)}, transitions takes {answer}"
            )
            self.divergences += 1
            self.violations.append(message)
            if self._keep is not None and len(self.violations) > self._keep:
                del self.violations[0]
            if self.on_divergence is not None:
                self.on_divergence(message)
