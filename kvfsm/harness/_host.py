"""What the CLI's process-spawning commands (`kvfsm demo`, `kvfsm bench`) check about this host
before they start: whether the KV buffers they are asked for fit in its memory.

Without the check a buffer too large for the host fails inside a spawned rank process
(numpy's MemoryError there, or the kernel's OOM killer part-way through filling it), and the
user reads a child's traceback instead of what to change.
"""

from __future__ import annotations

__all__ = ["available_memory", "require_memory"]

_MEMINFO = "/proc/meminfo"
_GIB = 2**30


def available_memory() -> int | None:
    """Bytes of memory the kernel says new allocations can have without swapping
    (`MemAvailable`), or None where it does not say (not Linux)."""
    try:
        with open(_MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_memory(need: int, what: str, hint: str, available: int | None = None) -> None:
    """ValueError saying `what` needs `need` bytes, how much the host has and `hint` (what to
    change), if that is more than `available` (default: `available_memory()`; no check where
    the host does not say)."""
    have = available_memory() if available is None else available
    if have is not None and need > have:
        raise ValueError(
            f"{what} need {need / _GIB:,.1f} GiB of memory, but this host has"
            f" {have / _GIB:,.1f} GiB available: {hint}"
        )
