"""Lifecycle models (models/) as `transitions` machines and the dispatch tables derived from them."""

from kvfsm.lifecycle._errors import (
    InternalProtocolError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    protocol_error,
)
from kvfsm.lifecycle._machine import MODEL_NAMES, Lifecycle, Rule, load, models_dir
from kvfsm.lifecycle._model import (
    STAY,
    CommandSpec,
    EventSpec,
    GuardSpec,
    LifecycleModel,
    MachineSpec,
    ModelError,
    Origin,
    StateSpec,
    TransitionSpec,
    decode_model,
)

__all__ = [
    "MODEL_NAMES",
    "STAY",
    "CommandSpec",
    "EventSpec",
    "GuardSpec",
    "InternalProtocolError",
    "Lifecycle",
    "LifecycleModel",
    "LocalProtocolError",
    "MachineSpec",
    "ModelError",
    "Origin",
    "ProtocolError",
    "RemoteProtocolError",
    "Rule",
    "StateSpec",
    "TransitionSpec",
    "decode_model",
    "load",
    "models_dir",
    "protocol_error",
]
