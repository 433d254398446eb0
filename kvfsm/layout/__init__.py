"""KV layouts and descriptor math."""

from kvfsm.layout._blocks import BlockLayout

__all__ = ["BlockLayout"]
