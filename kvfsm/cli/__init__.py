"""The `kvfsm` command line, the top layer: `demo`, `bench`, `scenario`, `check` and `diagrams`,
a package each, and what only they use (terminal rendering, model presets, the host check).
Nothing below this package imports it."""

from kvfsm.cli._main import main

__all__ = ["main"]
