"""`DeviceFence`: P exposes KV (posts a WRITE, grants a READ) only once the device wrote it.

On a GPU the forward pass is asynchronous: `wait_for_save` returns when the step's kernels are
queued, not run. vLLM's scheduler learns that a prefill finished only from the step's sampled
tokens, which reach the host after every kernel before them on the stream (the KV writes
included), so a `PrefillFinished` that vLLM hands the connector already follows its KV on the
device. The fence makes that explicit instead of resting on vLLM's scheduling: each step's
events wait for a CUDA event recorded at the end of the forward passes queued before them (in
order, on a thread of their own, so neither vLLM's thread nor the engine loop blocks). Where
the argument above holds, the event has completed and nothing waits (docs/vllm.md).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["DeviceFence", "Marker"]

_STOP = object()
_log = logging.getLogger("vllm.kvfsm")


class Marker(Protocol):
    """A point in the device's work (a `torch.cuda.Event` once recorded)."""

    def synchronize(self) -> None:
        """Return once the device has done all the work queued before this point."""


class DeviceFence:
    """Passes batches of events to `submit`, in order, each once the device has done the work
    queued before the batch was handed over. `marker()` makes a `Marker` at the current point
    of the device's work (default: a CUDA event recorded on the current stream)."""

    def __init__(
        self, submit: Callable[[Any], None], name: str, marker: Callable[[], Marker] | None = None
    ) -> None:
        self._submit = submit
        self._marker = marker or _cuda_marker
        self._latest: Marker | None = None  # vLLM's thread only
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-fence", daemon=True)
        self._thread.start()

    def written(self) -> None:
        """The forward passes queued so far write KV (vLLM's `wait_for_save`): mark the point."""
        self._latest = self._marker()

    def pass_on(self, events: Sequence[Any]) -> None:
        """Submit `events` once the device has done what was queued before the last `written`."""
        if events:
            self._queue.put((self._latest, list(events)))

    def close(self, timeout_s: float = 10.0) -> None:
        """Submit what is held (as its markers allow), then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            marker, events = item
            if marker is not None:
                marker.synchronize()  # releases the GIL while it waits
            for event in events:
                try:
                    self._submit(event)
                except Exception:  # the loop stopped: keep draining, so close() returns
                    _log.exception("kvfsm: an event held for the device was not submitted")


def _cuda_marker() -> Marker:
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event
