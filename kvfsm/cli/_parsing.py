"""What every command's parser shares."""

from __future__ import annotations

import argparse
from typing import TypeAlias

__all__ = ["Commands"]

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""The `kvfsm` parser's subcommands (argparse types this action privately)."""
