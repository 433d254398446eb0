"""kvfsm: a KV-cache transfer engine whose every request lifecycle is an explicit state machine."""

__version__ = "0.1.0"
__all__ = ["__version__"]
