"""Which method implements each guard and command a lifecycle model names.

The core's dispatcher binds a model's names to its side's methods by prefix (`Side`'s
`_req_`, `_peer_` and `_tally_`), so an IDE or a static walker stops at the handler table. This
names the methods the dispatcher binds, for the diagram pages' "implemented by" column and for
readers following a request through the code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from kvfsm.core._consumer import Consumer
from kvfsm.core._dispatch import method_name
from kvfsm.core._producer import Producer
from kvfsm.core._side import MODEL_PREFIXES, Side
from kvfsm.lifecycle import LifecycleModel

__all__ = ["implementations"]


def _owners(model: str) -> tuple[type[Side], ...]:
    """The sides whose dispatcher runs `model`: one for a request model, both otherwise."""
    if model.startswith("producer_"):
        return (Producer,)
    if model.startswith("consumer_"):
        return (Consumer,)
    return (Producer, Consumer)


def implementations(model: LifecycleModel) -> dict[str, tuple[Callable[..., Any], ...]]:
    """Per guard and command of `model`, the functions the dispatcher binds for it (one per
    distinct method: a peer or transfer name that P and D implement alike gives one).
    `AttributeError` names a guard or command no side implements; `ValueError` a model no side
    runs."""
    name = model.machine.name
    kind = "request" if name.startswith(("producer_", "consumer_")) else name
    if kind not in MODEL_PREFIXES:
        raise ValueError(f"no side of the core runs a lifecycle named {name!r}")
    prefix = MODEL_PREFIXES[kind]
    found: dict[str, tuple[Callable[..., Any], ...]] = {}
    kinds: list[tuple[Literal["guard", "command"], str]] = [
        *(("guard", g.name) for g in model.guards),
        *(("command", c.name) for c in model.commands),
    ]
    for kind, spec_name in kinds:
        attr = method_name(prefix, kind, spec_name)
        functions: list[Callable[..., Any]] = []
        for owner in _owners(name):
            function = getattr(owner, attr, None)
            if function is None:
                raise AttributeError(
                    f"lifecycle {name!r} names {kind} {spec_name!r}, but {owner.__name__} has"
                    f" no method {attr}"
                )
            if function not in functions:
                functions.append(function)
        found[spec_name] = tuple(functions)
    return found
