"""kvfsm as a vLLM KV connector (vLLM 0.32): `KvfsmConnector`, push or pull, P or D.

Importing this package imports vLLM; the rest of kvfsm never does.
"""

from kvfsm.vllm._connector import KvfsmConnector, KvfsmHandshake, KvfsmMetadata, KvfsmStats
from kvfsm.vllm._settings import KvfsmSettings, SettingsError

__all__ = [
    "KvfsmConnector",
    "KvfsmHandshake",
    "KvfsmMetadata",
    "KvfsmSettings",
    "KvfsmStats",
    "SettingsError",
]
