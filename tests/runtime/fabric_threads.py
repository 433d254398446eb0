"""A fabric wrapper that notes which threads call it, for the data-plane tests."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["ThreadRecorder"]


class ThreadRecorder:
    """Forwards every call to `fabric`, noting the calling thread's name in `threads`."""

    def __init__(self, fabric: Any) -> None:
        self.fabric = fabric
        self.threads: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.fabric, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.threads.add(threading.current_thread().name)
            return attr(*args, **kwargs)

        return call
